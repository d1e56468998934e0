"""Compile the fast runtime's Triton kernels for a GPU target on a machine without one, before spending GPU time.

The interpreter (TRITON_INTERPRET=1, the CPU tests) runs a kernel's Python but never compiles it, so a kernel that
passes every CPU test can still fail on the device: an op the compiler rejects, a tile that overflows shared
memory. Here Triton's active driver is replaced by one that only names the target (default sm_90, H100 / H200),
every launch compiles its kernel (as `warmup` does) instead of running, and the compiled kernel's shared memory is
checked against the card's 227 KiB per block. The runtime runs on CPU tensors at the real launch configurations:

  hybrid target at the Qwen3.6-27B GDN / attention head shapes (small hidden size): prefill, tree verify at 17 / 33
  / 65 / 129 nodes, commit, decode (gdn="triton", tree attention); a dense target at SmolLM2-135M's shapes: tree
  verify, commit, decode; the static Weaver tree build (SmolLM2 and Qwen3.6-27B presets, budgets 32 / 64 / 128,
  widths 2-16) with its frontier kernels, Weaver steps and candidate scoring; ancestor masks and their packing.

Kernel outputs are left unwritten (their buffers hold whatever they held): only compilation is checked, the results
are the GPU tests' business. The runtime's CUDA checks (`inference_kernel_ok`, `is_cuda` guards, the device's SM
count and capability) are patched for the run. A few minutes on 2 cores cold, about one with a warm Triton cache.

  python -m benchmarks.gpu.compile_check [--arch 90]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

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


def _pretend_cuda(arch: int) -> None:
    """The runtime's CUDA guards say yes for CPU tensors (the kernels then get CPU tensors, which compile-only never
    reads); the device's SM count and capability are the target's."""
    import tfm_runtime.fast.dense as dense
    import tfm_runtime.fast.hybrid as hybrid
    import tfm_runtime.models.common as common
    import tfm_runtime.models.weaver as weaver
    from tfm_kernels.small_attention import small_attention as fused_small_attention
    from tfm_kernels.swiglu import swiglu as fused_swiglu

    def kernel_ok(x, *params):
        ps = [p for p in params if p is not None]
        return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and all(p.dtype == x.dtype for p in ps)
    for m in (common, dense, hybrid, weaver):
        m.inference_kernel_ok = kernel_ok
    def small_attention(q, k, v, mask):                 # the runtime's choice, less its is_cuda
        if q.shape[-2] <= 128 and k.shape[-2] <= 128 and q.shape[-1] <= 256:
            return fused_small_attention(q, k, v, mask)
        return weaver._small_attention_bmm(q, k, v, mask)
    weaver.small_attention = small_attention
    weaver.swiglu = fused_swiglu
    real_score = weaver.Weaver.score

    def score(self, h, cand_ids, cand_logits, lm_head_weight, scoring=weaver.WeaverScoring(), rows=None):
        if rows is None:
            return real_score(self, h, cand_ids, cand_logits, lm_head_weight, scoring, rows)
        from tfm_kernels.candidate_logits import candidate_logits
        query = self.lm_head_query_in(h)
        _, logq = candidate_logits(query.reshape(-1, query.shape[-1]), lm_head_weight, cand_ids,
                                   bias=cand_logits.float(), rows=rows.reshape(-1))
        return logq.view(*rows.shape, cand_ids.shape[-1])
    weaver.Weaver.score = score
    props = types.SimpleNamespace(multi_processor_count=132, name=f"sm_{arch} (compile check)")
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: divmod(arch, 10)


def _hybrid(dtype, log) -> None:
    from benchmarks.runtime.shape27b_bench import SHAPE, target_model
    from tfm_runtime.fast.weaver_tree import ancestor_masks
    shape = dict(SHAPE, vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=4)
    os.environ["TRITON_INTERPRET"] = "1"                # HybridModel takes gdn="triton" on the CPU only then
    try:
        from tfm_runtime.fast.hybrid import HybridModel
        real = HybridModel.from_hf.__func__
        HybridModel.from_hf = classmethod(lambda cls, hf, taps=(), **kw: real(cls, hf, taps, **{**kw, "gdn": "triton"}))
        try:
            model = target_model(shape, "cpu", dtype, 512)[0]
        finally:
            HybridModel.from_hf = classmethod(real)
    finally:
        del os.environ["TRITON_INTERPRET"]
    model.attention = "triton"
    _target(model, "hybrid (Qwen3.6-27B heads)", log, ancestor_masks)


def _dense(dtype, log) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tfm_runtime.fast.dense import DenseModel
    from tfm_runtime.fast.weaver_tree import ancestor_masks
    cfg = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=512)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model = DenseModel.from_hf(hf, [0, 1], max_seq_len=512)
    model.attention = "triton"
    _target(model, "dense (SmolLM2-135M)", log, ancestor_masks)


@torch.no_grad()
def _target(model, name: str, log, ancestor_masks) -> None:
    model.prefill(torch.randint(0, 1000, (40,)))
    from tfm_kernels.pack_bits import pack_bits
    from tfm_kernels.tree_ancestors import tree_ancestors
    for n in (17, 33, 65, 129):
        parents = torch.arange(-1, n - 1)[None]                                       # [1, n] a chain
        pack_bits(tree_ancestors(parents, 15))
        anc = ancestor_masks(parents, 15)[0]                                          # [n, n] (the reference)
        model.verify_tree(torch.randint(0, 1000, (n,)), torch.arange(n).clamp(max=15), anc, 40)
    model.commit(torch.tensor([40]), torch.tensor([0, 1, 2]))
    model.decode(torch.tensor([3]), torch.tensor([43]))
    log(name)


@torch.no_grad()
def _weaver(dtype, log) -> None:
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder
    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    presets = (("SmolLM2", WeaverConfig(d_model=576, d_embed=576, d_rank=256, num_layers=2, num_heads=4, mlp_dim=768,
                                        lookahead=15, candidate_pool=512)),
               ("Qwen3.6-27B", WeaverConfig.qwen36_27b()))
    for name, cfg in presets:
        w, H = Weaver(cfg).to(dtype).eval(), cfg.d_model
        table = torch.randn(4096, H, dtype=dtype)                                        # embeddings and LM head
        inputs = (torch.tensor([1]), torch.randn(1, H, dtype=dtype), torch.randn(1, 15, H, dtype=dtype),
                  torch.randint(0, 4096, (1, 15, 512)), torch.randn(1, 15, 512, dtype=dtype))
        for budget, width in ((32, 2), (32, 8), (64, 4), (64, 8), (64, 16), (128, 8)):
            b = StaticWeaverTreeBuilder(w, table, table, budget, K=512, L=15, batch=1, width=width, dtype=dtype)
            b.fused_frontier = True
            b._first(*inputs)
            b._second(*inputs)
        log(f"Weaver build ({name})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="compute capability x 10")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter never compiles a kernel")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    _import_kernels()
    _pretend_cuda(args.arch)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with CompileOnly(args.arch) as check:
        def log(what):
            print(f"{what}: {len(check.records)} launches compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
        _hybrid(torch.bfloat16, log)
        _dense(torch.bfloat16, log)
        _weaver(torch.bfloat16, log)
    limit, worst = SHARED_LIMIT[args.arch], {}
    for kernel, warps, shared in check.records:
        worst[kernel] = max(worst.get(kernel, (0, 0)), (shared, warps))
    print(f"\n{'kernel':36s} {'max shared':>10s}  (sm_{args.arch}, limit {limit})")
    for kernel, (shared, _) in sorted(worst.items()):
        print(f"{kernel:36s} {shared:10d}{'  OVER' if shared > limit else ''}")
    over = [k for k, (s, _) in worst.items() if s > limit]
    print(f"{len(worst)} kernels, {len(check.records)} launches compiled for sm_{args.arch}; "
          f"{'over the shared-memory limit: ' + ', '.join(over) if over else 'all within the shared-memory limit'}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
