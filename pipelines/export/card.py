"""The model cards (README.md with YAML metadata) of a Weaver adapter and of a DFlash drafter, and the acceptance
plot they show. Everything comes from the run's files (config, contract, held-out evaluation) and the optional
acceptance benchmark results; nothing is measured here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pipelines.export.config import REPO_ID
from pipelines.export.run import RunFolder
from pipelines.export.sglang import FORK_COMMIT, FORK_FILE, FORK_REPO
from tfm_runtime.loading import ModelSpec

PLOT = "acceptance_by_depth.png"
TAGS = ["tfm", "speculative-decoding", "dflash"]
# training settings the card lists per model (the full resolved config is the run's train_config.json)
OPTIM_FIELDS = ("steps", "micro_batch", "grad_accum", "lr", "warmup_steps", "weight_decay", "grad_clip", "zero_stage",
                "precision", "seed", "heldout_fraction")
TRAIN_FIELDS = {"weaver": ("preset", "d_rank", "num_layers", "num_heads", "mlp_dim", "loss", "depth_gamma")
                + OPTIM_FIELDS,
                "dflash": ("drafter_layers", "block_size", "drafter_intermediate_size", "anchors_per_sequence",
                           "loss_decay_gamma", "max_seq_len") + OPTIM_FIELDS}


@dataclass
class CardInfo:
    name: str                      # the card's title: the repository id, or the artifact folder's name
    load_id: str                   # what the card's code loads: the repository id, or the folder's path
    hub: bool                      # load_id is a Hub repository
    run: RunFolder
    target: ModelSpec
    drafter: ModelSpec | None      # Weaver: the DFlash drafter it needs
    license: str
    datasets: list[str]
    parameters: int
    bench: dict | None = None      # acceptance benchmark results (benchmarks/runtime/acceptance.py --out)
    sglang_file: str | None = None  # the fork-layout checkpoint written beside the safetensors


def _is_hub_id(spec: ModelSpec | None) -> bool:
    return spec is not None and bool(REPO_ID.match(spec.path)) and not os.path.exists(spec.path)


def metadata(info: CardInfo, tags: list[str]) -> str:
    """The card's YAML block (between --- lines)."""
    from huggingface_hub import ModelCardData
    data = ModelCardData(library_name="tfm", license=info.license, pipeline_tag="text-generation", tags=tags,
                         base_model=info.target.path if _is_hub_id(info.target) else None,
                         datasets=info.datasets or None)
    return f"---\n{data.to_yaml()}\n---\n"


def _spec(spec: ModelSpec) -> str:
    """A spec as Python source for the card's code."""
    return f'ModelSpec("{spec.path}", revision="{spec.revision}")' if spec.revision else f'"{spec.path}"'


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _training(info: CardInfo) -> str:
    run = info.run
    rows = [[f"`{d['path']}`", d.get("mode", "?"), d.get("shards", "?"), d.get("rows", "?"),
             f"`{(d.get('manifest_sha256') or 'not found')[:16]}`"] for d in run.data]
    cfg = run.train_config
    settings = ", ".join(f"{k}={cfg[k]}" for k in TRAIN_FIELDS[run.model] if cfg.get(k) is not None)
    return ("## Training\n\n"
            f"Run `{run.name}` (run hash `{cfg.get('run_hash')}`), checkpoint `{run.checkpoint}/` at step {run.step}, "
            f"trained by `pipelines.train` from these collect folders (one row per anchor, or per sequence in "
            f"text-only mode; the manifest lists every shard's sha256):\n\n"
            + _table(["data", "mode", "shards", "rows", "manifest sha256"], rows)
            + f"\nSettings: {settings}. `provenance.json` holds the code revision, package versions, the training "
              f"config's hash and the sha256 of every file here.\n\n")


def _bench(bench: dict | None) -> str:
    if not bench:
        return ""
    rows = [[r["dataset"], r["temperature"], r["proposal"], r["budget"], r["verification"], r["acceptance_length"],
             r["mean_tree_size"]] for r in bench["rows"]]
    rev = (bench.get("env") or {}).get("git_revision", "?")
    return (f"Acceptance benchmark (`python -m benchmarks.runtime.acceptance`, world `{bench.get('world', '?')}`, code "
            f"revision `{rev}`): mean acceptance length (tokens per verify step, bonus included) of lossless "
            f"decoding.\n\n" + _table(["dataset", "T", "proposal", "budget", "verification", "acceptance length",
                                       "mean tree size"], rows) + "\n")


def weaver_card(info: CardInfo) -> str:
    c, ev, run = info.run.contract, info.run.eval, info.run
    d = info.drafter
    if info.sglang_file is None:
        fetch, sglang = "# export with --format sglang-dflash-tfm to add the fork's checkpoint file\n", "weaver.pt"
    elif not info.hub:                                                   # a local folder: its file
        fetch, sglang = "", os.path.join(info.load_id, info.sglang_file)
    else:
        fetch, sglang = f"hf download {info.name} {info.sglang_file} --local-dir weaver\n", \
            f"weaver/{info.sglang_file}"
    depth_rows = [[i + 1, w, f, h] for i, (w, f, h) in enumerate(zip(ev["top1_weaver_by_depth"],
                                                                     ev["top1_dflash_by_depth"],
                                                                     ev["hit_rate_by_depth"]))]
    budgets = sorted(int(k.rsplit("_", 1)[1]) for k in ev if k.startswith("accept_weaver_"))
    budget_rows = [["chain", ev["accept_chain_weaver"], ev["accept_chain_dflash"]]]
    budget_rows += [[b, ev[f"accept_weaver_{b}"], ev[f"accept_ddtree_{b}"]] for b in budgets]
    text = (
        f"# {info.name}\n\n"
        f"A **Weaver** adapter for speculative decoding with tfm (Trees from Marginals). A DFlash block drafter "
        f"proposes the top-{c.candidate_pool} candidates at each of {c.lookahead} future positions in one pass; "
        f"Weaver ({info.parameters:,} parameters) re-scores them autoregressively, conditioned on the tokens already "
        f"chosen, and builds a proposal tree under a node budget that the target verifies in one forward pass, "
        f"losslessly (the output is the target's own). It reads the target's embedding and LM head, never copies "
        f"them, and works only with the target and drafter it was trained for:\n\n"
        + _table(["model", "id", "revision"], [["target", f"`{info.target.path}`", info.target.revision or "-"],
                                              ["DFlash drafter", f"`{d.path}`", d.revision or "-"]])
        + f"\nThe contract (`contract.json`, checked by `load_adapter` against the models it is given): vocab "
          f"{c.vocab_size}, target hidden size {c.target_hidden_size}, tap layers {list(c.tap_layer_ids)}, DFlash "
          f"block size {c.block_size}, mask token {c.mask_token_id}, candidate pool K={c.candidate_pool}, lookahead "
          f"L={c.lookahead}, tokenizer hash `{c.tokenizer_hash}`.\n\n"
        "## Use\n\n```python\n"
        "from tfm_runtime import ModelSpec, SpeculativeDecoder, load_adapter, load_drafter, load_target\n\n"
        f"drafter = load_drafter({_spec(d)})\n"
        f"target = load_target({_spec(info.target)}, drafter.cfg.target_layer_ids)\n"
        f'adapter = load_adapter("{info.load_id}", target=target, drafter=drafter)   # safetensors; contract checked\n'
        "dec = SpeculativeDecoder(target, drafter, adapter, tree_budget=64)\n"
        "out = dec.generate(prompt_ids, max_new_tokens=256, temperature=0.0)    # prompt_ids: token ids\n"
        "print(out.tokens, out.stats.summary())   # acceptance length, time per stage, tokens/s\n```\n\n"
        "## Serve with SGLang\n\n"
        f"The authors' SGLang fork ({FORK_REPO} at `{FORK_COMMIT}`, algorithm `DFLASH_TFM`) loads a Weaver from "
        f"its own checkpoint layout (`{info.sglang_file or FORK_FILE}`, written by `--format sglang-dflash-tfm`):"
        f"\n\n```\n{fetch}"
        f"python -m sglang.launch_server --model-path {info.target.path} \\\n"
        f"    --speculative-algorithm DFLASH_TFM --speculative-draft-model-path {d.path} \\\n"
        f"    --speculative-dflash-tfm-path {sglang} --speculative-dflash-tfm-tree-budget 64\n```\n\n"
        + _training(info)
        + "## Evaluation\n\n"
        f"Held-out rows of the run ({ev.get('rows', '?')} anchors never trained on), step {run.step}, from the "
        f"training data alone (`pipelines/train/evaluate.py`). Per depth: how often the top-1 candidate equals "
        f"the target's argmax given the true prefix (the chance a greedy draft is accepted at that depth), and "
        f"how often the target's token is among the {c.candidate_pool} candidates.\n\n"
        + _table(["depth", "Weaver top-1", "DFlash top-1", "candidate hit rate"], depth_rows)
        + f"\n![acceptance by depth]({PLOT})\n\n"
        "Simulated greedy acceptance length (accepted drafts + 1) of chains and of trees with a node budget:\n\n"
        + _table(["budget", "Weaver", "DFlash chain / DDTree"], budget_rows) + "\n"
        + _bench(info.bench)
    )
    return metadata(info, TAGS + ["weaver"]) + text


def dflash_card(info: CardInfo, config: dict) -> str:
    ev, run = info.run.eval, info.run
    dc = config["dflash_config"]
    depth_rows = [[i + 1, a] for i, a in enumerate(ev["top1_by_position"])]
    vllm = json.dumps({"method": "dflash", "model": info.load_id, "num_speculative_tokens": config["block_size"] - 1})
    text = (
        f"# {info.name}\n\n"
        f"A **DFlash** block drafter for `{info.target.path}`"
        f"{' (revision ' + info.target.revision + ')' if info.target.revision else ''}, trained with tfm. In one "
        f"forward pass it drafts a block of {config['block_size'] - 1} tokens after the last accepted one, "
        f"conditioned on the target's hidden states at layers {dc['target_layer_ids']}; it has no embedding or "
        f"LM head of its own (it uses the target's). {info.parameters:,} parameters, layers: "
        f"{config['num_hidden_layers']}, hidden size {config['hidden_size']}, mask token {dc['mask_token_id']}. "
        "The folder is z-lab's DFlash layout (`config.json` with `architectures: [DFlashDraftModel]` and "
        "`dflash_config`, `model.safetensors`), the one z-lab's published drafters use, which SGLang's `DFLASH` "
        "algorithm, vLLM's `dflash` method and tfm read.\n\n"
        "## Use\n\n```python\n"
        "from tfm_runtime import ModelSpec, SpeculativeDecoder, load_drafter, load_target\n\n"
        f'drafter = load_drafter("{info.load_id}")\n'
        f"target = load_target({_spec(info.target)}, drafter.cfg.target_layer_ids)\n"
        "dec = SpeculativeDecoder(target, drafter, tree_budget=64)        # DDTree proposals; chain: proposal='chain'\n"
        "out = dec.generate(prompt_ids, max_new_tokens=256, temperature=0.0)\n```\n\n"
        "## Serve\n\n```\n"
        f"python -m sglang.launch_server --model-path {info.target.path} --speculative-algorithm DFLASH \\\n"
        f"    --speculative-draft-model-path {info.load_id} --speculative-num-draft-tokens {config['block_size']}\n"
        f"vllm serve {info.target.path} --speculative-config '{vllm}'\n```\n\n"
        + _training(info)
        + "## Evaluation\n\n"
        f"Held-out sequences of the run ({ev.get('blocks', '?')} blocks), step {run.step}: top-1 agreement with "
        f"the target's token per block position, and the simulated greedy chain acceptance length "
        f"{ev['accept_chain']:.3f} (accepted drafts + 1).\n\n"
        + _table(["position", "top-1"], depth_rows)
        + f"\n![acceptance by depth]({PLOT})\n\n"
        + _bench(info.bench)
    )
    return metadata(info, TAGS + ["dflash-drafter"]) + text


def acceptance_plot(path: str, series: dict[str, list[float]], title: str) -> None:
    """A PNG of per-depth acceptance, one line per series; no timestamp in the file (re-exports are identical)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for label, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel("depth (draft position)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
