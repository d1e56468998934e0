"""Compile the fast runtime's Triton kernels for a GPU target on a machine without one, before spending GPU time.

The interpreter (TRITON_INTERPRET=1, the CPU tests) runs a kernel's Python but never compiles it, so a kernel that
passes every CPU test can still fail on the device: an op the compiler rejects, a tile that overflows shared
memory. Here Triton's active driver is replaced by one that only names the target (default sm_90, H100 / H200),
every launch compiles its kernel (as `warmup` does) instead of running, and the compiled kernel's shared memory is
checked against the card's 227 KiB per block. The runtime runs on CPU tensors at the real launch configurations:

  hybrid target at the Qwen3.6-27B GDN / attention head shapes (small hidden size): prefill, tree verify at 17 / 33
  / 65 / 129 nodes, commit, decode (gdn="triton", tree attention); a dense target at SmolLM2-135M's shapes: tree
  verify, commit, decode; the static Weaver tree build (SmolLM2 and Qwen3.6-27B presets, budgets 32 / 64 / 128,
  widths 2-16) with its frontier kernels, Weaver steps and candidate scoring; ancestor masks and their packing;
  the decoder's greedy acceptance at 17 / 65 / 129 nodes; one whole FastDecoder round (Weaver(64), width 8) at
  SmolLM2's shapes.

Kernel outputs are left unwritten (their buffers hold whatever they held): only compilation is checked, the results
are the GPU tests' business.

It also counts the launches of each stage (Triton launches plus the torch ops that launch a kernel: every aten op but
views and allocations), which set most of a small model's step time: a target's decode and tree verify (per layer
and per call, and the total at the real depth: SmolLM2's 30 layers, Qwen3.6-27B's 16 groups of 3 GDN + 1 attention
layers), the Weaver build's first phase per width and a FastDecoder round by stage (its draft, build, verify,
acceptance and commit). `--out` writes them as a results file.

The runtime's device test (`tfm_runtime.models.common.kernel_device`, which every kernel path asks) and the
device's SM count and capability are patched for the run. A few minutes on 2 cores cold, one or two with a warm
Triton cache.

  python -m benchmarks.gpu.compile_check [--arch 90] [--out benchmarks/results/kernel_launches_cpu.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHARED_LIMIT = {90: 232448, 100: 232448}          # bytes of shared memory one block may use (sm_90, sm_100)


def _import_kernels() -> None:
    """Every kernel module, imported while TRITON_INTERPRET is unset, so that each kernel is a compiled JITFunction."""
    import importlib
    import pkgutil

    import tfm_kernels
    for m in pkgutil.walk_packages(tfm_kernels.__path__, "tfm_kernels."):
        importlib.import_module(m.name)


class CompileOnly:
    """Within the block, Triton targets `arch` through a driver that has no device, and every JITFunction launch
    compiles its kernel and records (kernel name, num_warps, shared bytes) in `records` without running it."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)
        self.records: list[tuple[str, int, int]] = []

    def __enter__(self):
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
        target, records = self.target, self.records
        self._driver, self._old = driver, driver._active
        driver.set_active(types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d=None: 0,
                                                get_current_target=lambda: target))
        self._run = run = JITFunction.run

        def compile_only(fn, *args, grid, warmup, **kwargs):
            kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)
            records.append((fn.fn.__name__, kernel.metadata.num_warps, kernel.metadata.shared))
            return kernel
        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction
        JITFunction.run = self._run
        self._driver._active = self._old


class TorchLaunches(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on CUDA (not views, allocations or the custom ops that wrap a Triton
    kernel, which `CompileOnly` counts) and the host reads (`.item()`, `.tolist()`: a device sync there)."""

    NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "set_",
                 "_unsafe_view"}                   # a view not marked as one

    def __init__(self):
        super().__init__()
        self.launches = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name == "_local_scalar_dense":
            self.reads += 1
        elif func.namespace == "aten" and not func.is_view and name not in self.NO_LAUNCH:
            self.launches += 1
        return func(*args, **(kwargs or {}))


def launches(check: "CompileOnly", fn) -> dict:
    """fn() run once to compile, then again counted -> {"triton", "torch", "launches", "host_reads"}."""
    fn()
    n0 = len(check.records)
    with TorchLaunches() as t:
        fn()
    tri = len(check.records) - n0
    return {"triton": tri, "torch": t.launches, "launches": tri + t.launches, "host_reads": t.reads}


def _pretend_cuda(arch: int) -> None:
    """The runtime's one device test (`tfm_runtime.models.common.kernel_device`) says yes for CPU tensors in every
    module that reads it, so each kernel path is taken as on CUDA (the kernels then get CPU tensors, which
    compile-only never reads); the device's SM count and capability are the target's."""
    import importlib
    for name in ("tfm_runtime.fast.dense", "tfm_runtime.fast.hybrid", "tfm_runtime.fast.weaver_tree",
                 "tfm_runtime.models.weaver"):
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("tfm_runtime.") and hasattr(module, "kernel_device"):
            module.kernel_device = lambda t: True
    props = types.SimpleNamespace(multi_processor_count=132, name=f"sm_{arch} (compile check)")
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: divmod(arch, 10)


def _hybrid(layers: int, dtype):
    """A hybrid target at the Qwen3.6-27B GDN / attention head shapes (hidden 512), `layers` layers (every fourth full
    attention), gdn="triton" and tree attention."""
    from benchmarks.runtime.shape27b_bench import SHAPE, target_model
    from tfm_runtime.fast.hybrid import HybridModel
    shape = dict(SHAPE, vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=layers)
    os.environ["TRITON_INTERPRET"] = "1"                # HybridModel takes gdn="triton" on the CPU only then
    real = HybridModel.from_hf.__func__
    HybridModel.from_hf = classmethod(lambda cls, hf, taps=(), **kw: real(cls, hf, taps, **{**kw, "gdn": "triton"}))
    try:
        model = target_model(shape, "cpu", dtype, 512)[0]
    finally:
        HybridModel.from_hf = classmethod(real)
        del os.environ["TRITON_INTERPRET"]
    model.attention = "triton"
    return model


def _dense(layers: int, dtype):
    """A dense target at SmolLM2-135M's shapes (vocab 1024), `layers` layers, tree attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tfm_runtime.fast.dense import DenseModel
    cfg = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=512)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model = DenseModel.from_hf(hf, [0, layers - 1], max_seq_len=512)
    model.attention = "triton"
    return model


@torch.no_grad()
def _target(check, model) -> dict:
    """Compile a target's kernels at tree sizes 17 / 33 / 65 / 129, commit and decode -> the launches of decode and
    of the verify of 65 nodes."""
    from tfm_kernels.pack_bits import pack_bits
    from tfm_kernels.tree_ancestors import tree_ancestors
    from tfm_runtime.fast.weaver_tree import ancestor_masks
    model.prefill(torch.randint(0, 1000, (40,)))
    trees = {}
    for n in (17, 33, 65, 129):
        parents = torch.arange(-1, n - 1)[None]                                       # [1, n] a chain
        pack_bits(tree_ancestors(parents, 15))
        trees[n] = (torch.randint(0, 1000, (n,)), torch.arange(n).clamp(max=15), ancestor_masks(parents, 15)[0])
        model.verify_tree(*trees[n], 40)
    model.commit(torch.tensor([40]), torch.tensor([0, 1, 2]))
    return {"decode": launches(check, lambda: model.decode(torch.tensor([3]), torch.tensor([43]))),
            "verify65": launches(check, lambda: model.verify_tree(*trees[65], 40))}


def _per_layer(check, build, small: int, big: int, groups: int) -> dict:
    """Targets of `small` and `big` layers -> per stage: launches per `big - small` layers, the fixed rest, and the
    total at `groups` such groups (the real depth)."""
    a, b = _target(check, build(small)), _target(check, build(big))
    rows = {}
    for stage in a:
        per = b[stage]["launches"] - a[stage]["launches"]
        fixed = a[stage]["launches"] - per * (small // (big - small))
        rows[stage] = {"per_group": per, "fixed": fixed, "total": fixed + per * groups,
                       "host_reads": b[stage]["host_reads"]}
    return rows


@torch.no_grad()
def _round(check, dtype) -> dict:
    """One FastDecoder round at T = 0 with a Weaver(64) of width 8 in `runtime_bench`'s SmolLM2 world without
    arguments (a random target in SmolLM2's shape, whose LM head requires a gradient as a real one's does; the
    committed drafter; a random Weaver in the recipe's shape), as with CUDA graphs: trees padded, the frontier
    kernels and tree attention on -> launches per stage (the verify graph's input copies not counted)."""
    from benchmarks.runtime.runtime_bench import load_world
    from tfm_runtime.engine import DecodeStats
    from tfm_runtime.fast.decoder import FastDecoder
    world = argparse.Namespace(smoke=False, target=None, drafter=None, adapter=None)
    target, drafter, weaver, _ = load_world(world, torch.device("cpu"), dtype)
    dec = FastDecoder(target, drafter, weaver, tree_budget=64, width=8, max_seq_len=256)
    dec.pad_trees, dec.weaver_builder.fused_frontier, dec.model.attention = True, True, "triton"   # as on CUDA
    out = dec.model.prefill(torch.randint(0, 1000, (16,)))
    dec.dflash.prefill(out.taps)
    dec.start_dev.fill_(16)
    b, stats = dec.weaver_builder, DecodeStats()
    logits, hidden = dec.dflash.draft(None)
    trees, nodes = dec._static_tree(b, dec.accept_dev[-1:], logits, hidden, dec.h_last)
    out = dec.runner.verify_tree(*nodes, dec.start_dev)
    dec.accept_dev.zero_()                            # compile-only kernels write nothing: keep the path in range
    return {"draft": launches(check, lambda: dec.dflash.draft(None)),
            "tree": launches(check, lambda: dec._static_tree(b, dec.accept_dev[-1:], logits, hidden, dec.h_last)),
            "verify": launches(check, lambda: dec.runner.verify_tree(*nodes, dec.start_dev)),
            "accept": launches(check, lambda: dec._accept(trees, out, True)),
            "commit": launches(check, lambda: dec._commit_ops(out)),
            "round": launches(check, lambda: dec._queue_round(b, True, stats, time.perf_counter()))}


def _accept() -> None:
    """Compile the greedy acceptance (`tfm_kernels.greedy_accept`) at tree sizes 17 / 65 / 129, paths of 16 nodes,
    with and without `hold`."""
    from tfm_kernels.greedy_accept import greedy_accept
    for n in (17, 65, 129):
        z, one = torch.zeros(1, n, dtype=torch.long), torch.ones(1, dtype=torch.long)
        greedy_accept(z, z, z, one, 16)
        greedy_accept(z, z, z, one, 16, hold=torch.zeros(1, dtype=torch.bool))


@torch.no_grad()
def _weaver(check, dtype) -> dict:
    """Compile the static Weaver build (both phases) at each preset, budget and width -> launches of the first
    phase (the only one almost every build runs) per preset and (budget, width)."""
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder
    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    presets = (("SmolLM2", WeaverConfig(d_model=576, d_embed=576, d_rank=256, num_layers=2, num_heads=4, mlp_dim=768,
                                        lookahead=15, candidate_pool=512)),
               ("Qwen3.6-27B", WeaverConfig.qwen36_27b()))
    rows = {}
    for name, cfg in presets:
        w, H = Weaver(cfg).to(dtype).eval(), cfg.d_model
        table = torch.randn(4096, H, dtype=dtype)                                        # embeddings and LM head
        inputs = (torch.tensor([1]), torch.randn(1, H, dtype=dtype), torch.randn(1, 15, H, dtype=dtype),
                  torch.randint(0, 4096, (1, 15, 512)), torch.randn(1, 15, 512, dtype=dtype))
        for budget, width in ((32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (64, 16), (128, 8)):
            b = StaticWeaverTreeBuilder(w, table, table, budget, K=512, L=15, batch=1, width=width, dtype=dtype)
            b.fused_frontier = True
            b._first(*inputs)
            b._second(*inputs)
            rows[f"{name} budget {budget} width {width}"] = {"rounds": b.first_rounds,
                                                              **launches(check, lambda: b._first(*inputs))}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="compute capability x 10")
    ap.add_argument("--out", help="results JSON of the launch counts")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter never compiles a kernel")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from benchmarks.common import env, write_results
    run_env = env()
    _import_kernels()
    _pretend_cuda(args.arch)
    torch.manual_seed(0)
    t0, dt = time.perf_counter(), torch.bfloat16
    with CompileOnly(args.arch) as check:
        targets = {"SmolLM2-135M (dense, 30 layers)": _per_layer(check, lambda n: _dense(n, dt), 1, 2, 30),
                   "Qwen3.6-27B (hybrid, 16 x (3 GDN + 1 attention))":
                       _per_layer(check, lambda n: _hybrid(n, dt), 4, 8, 16)}
        _accept()
        round_ = _round(check, dt)
        print(f"targets: {len(check.records)} launches compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
        builds = _weaver(check, dt)
        print(f"Weaver builds: {len(check.records)} launches compiled ({time.perf_counter() - t0:.0f} s)", flush=True)

    print(f"\n{'target':50s} {'stage':9s} {'per layer group':>15s} {'fixed':>6s} {'total':>6s} {'host reads':>10s}")
    for name, stages in targets.items():
        for stage, r in stages.items():
            print(f"{name:50s} {stage:9s} {r['per_group']:15d} {r['fixed']:6d} {r['total']:6d} {r['host_reads']:10d}")
    print(f"\n{'FastDecoder round, Weaver(64) width 8, SmolLM2':50s} " + "  ".join(
        f"{k} {r['launches']}" for k, r in round_.items()))
    print(f"\n{'Weaver build, first phase':36s} {'rounds':>6s} {'triton':>6s} {'torch':>6s} {'launches':>8s}")
    for name, r in builds.items():
        print(f"{name:36s} {r['rounds']:6d} {r['triton']:6d} {r['torch']:6d} {r['launches']:8d}")
    limit, worst = SHARED_LIMIT[args.arch], {}
    for kernel, warps, shared in check.records:
        worst[kernel] = max(worst.get(kernel, (0, 0)), (shared, warps))
    print(f"\n{'kernel':36s} {'max shared':>10s}  (sm_{args.arch}, limit {limit})")
    for kernel, (shared, _) in sorted(worst.items()):
        print(f"{kernel:36s} {shared:10d}{'  OVER' if shared > limit else ''}")
    over = [k for k, (sh, _) in worst.items() if sh > limit]
    print(f"{len(worst)} kernels, {len(check.records)} launches compiled for sm_{args.arch}; "
          f"{'over the shared-memory limit: ' + ', '.join(over) if over else 'all within the shared-memory limit'}")
    if args.out:
        write_results(args.out, {"env": run_env, "arch": f"sm_{args.arch}", "targets": targets,
                                 "fastdecoder_round_weaver64_w8": round_,
                                 "weaver_build_first_phase": builds,
                                 "max_shared_bytes": {k: sh for k, (sh, _) in sorted(worst.items())}})
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
