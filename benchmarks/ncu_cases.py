"""One launch of a named kernel case inside an NVTX range ``ncu``, for Nsight Compute.

Each case builds its inputs at a shape the open issues care about, calls the op three times
(compiles, autotuning, the CUDA extension's first-call setup), then once more inside the range:

    ncu --nvtx --nvtx-include "ncu/" --clock-control none --set full -o OUT \\
        python benchmarks/ncu_cases.py CASE

(``gpu_check.sh ncu-cases`` runs that over NCU_CASES and prints each report's headline
metrics.) ncu flushes the caches before the profiled launch (--cache-control all, its
default), so weights come from HBM as in a model step.

Cases (H200 shapes; bf16):
  proj_linear     F.linear x[8, 5120] w[1280, 5120]: DFlash 2's kernel projection at batch 1
                  (cuBLAS; ~36% of copy in session 23)
  proj_triton     the same GEMM with the Triton skinny GEMM (models.linear's best sweep
                  config for it, or proj_config's)
  proj_splitk     the same GEMM with the split-K Triton kernel (bn 32, bk 128, 4 slices)
  o_cublas        F.linear x[1, 4096] w[4096, 4096] (the target's o_proj at batch 1)
  o_triton        the same with models.linear's table config for it (Triton)
  conv_t8         grouped_dyn_conv, CUDA, x[8, 5120], K 2, group 16, blocks of 8
  conv_t4096      the same at T 4096 (65% of copy; issue 16 asks 70)
  convnorm_t8     conv_add_rms_norm_, CUDA, T 8
  convnorm_t4096  the same at T 4096 (63% of copy)
  ctxrms_t8       context_kv_ with hidden_rms, CUDA, 8 tokens, Qwen3-8B-DFlash (x[8, 4096],
                  w_kv[10240, 4096], 5 layers x 8 KV heads x D 128, paged caches): the vLLM
                  plugin's precompute at batch 8 (cuBLAS GEMM + the fused epilogue, ~4.5 us a
                  call in session 22's vLLM profile)
  ctxrms_t1       the same at 1 token (the plugin's decode call at batch 1)
  ctxrms_t32      the same at 32 tokens
  skinny_o        the skinny CUDA GEMM (kv_proj's C++ path at 1-8 rows):
                  x[1, 4096] w[4096, 4096], the target's o_proj at batch 1 (vs o_cublas)
  skinny_qkv      the same, x[1, 4096] w[6144, 4096] (qkv at batch 1)
  skinny_proj2    the same, x[8, 5120] w[1280, 5120] (vs proj_linear)
  topk_b1         row_topk, CUDA, z[7, 248320] k 16 (DFlash 2's selector input at batch 1)
  select_b1       select_candidates, CUDA, R 1, J 7, k 16, rank 256
"""
import argparse
import sys
from pathlib import Path

try:
    import dflash_ops  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import dflash_ops  # noqa: F401

import torch
import torch.nn.functional as F

from dflash_ops import dispatch

H2, K, GS, BLOCK = 5120, 2, 16, 8  # DFlash 2 (Qwen3.8-27B-DFlash2): hidden, taps, group, block
BF16 = torch.bfloat16


def _rand(*shape):
    return torch.randn(*shape, dtype=BF16, device="cuda")


def _splitk_linear(x, w):
    from dflash_ops.triton.context import ProjCfg, kv_proj
    cfg = ProjCfg(16, 32, 128, 8, 4, 4, True, False, 4)
    return lambda: kv_proj(x, w, None, cfg=cfg)


def _triton_linear(x, w):
    from dflash_ops.models import linear as lin
    from dflash_ops.triton.context import ProjCfg, kv_proj, proj_config

    cfg = lin.TABLE.get((w.shape[0], w.shape[1]), {}).get(lin.m_bucket(x.shape[0]))
    cfg = ProjCfg(*cfg) if cfg else proj_config(x.shape[0], w.shape[0], w.shape[1])
    print(f"triton config {cfg}")
    return lambda: kv_proj(x, w, None, cfg=cfg)


def _conv(t):
    from dflash_ops.ops.conv import grouped_dyn_conv
    x, dyn, base = _rand(t, H2), _rand(t, 2, K, H2 // GS)[:, 0], _rand(K, H2)
    return lambda: grouped_dyn_conv(x, dyn, base, GS, BLOCK)


def _convnorm(t):
    from dflash_ops.ops.conv import conv_add_rms_norm
    x, r, dyn, base = _rand(t, H2), _rand(t, H2), _rand(t, 2, K, H2 // GS)[:, 0], _rand(K, H2)
    w = 1 + 0.1 * _rand(H2)
    return lambda: conv_add_rms_norm(x, r, dyn, base, GS, BLOCK, w, 1e-6)


def _ctxrms(t):
    from dflash_ops.ops.context import context_kv_
    from dflash_ops.ops.rope import make_cos_sin_cache
    layers, hkv, d, h, blocks, bs = 5, 8, 128, 4096, 64, 16
    x, w = _rand(t, h), _rand(layers * 2 * hkv * d, h) * h ** -0.5
    kw = 1 + 0.1 * _rand(layers, d)
    pos = torch.arange(1000, 1000 + t, device="cuda")
    cs = make_cos_sin_cache(4096, d, 1e6, device="cuda")
    slots = torch.randperm(blocks * bs, device="cuda")[:t]
    kc = [torch.zeros(blocks, bs, hkv, d, dtype=BF16, device="cuda") for _ in range(layers)]
    vc = [torch.zeros_like(c) for c in kc]
    return lambda: context_kv_(x, w, None, kw, pos, cs, slots, kc, vc, 1e-6, True, None, True)


def _skinny(m, n, h):
    x, w = _rand(m, h), _rand(n, h) * h ** -0.5
    return lambda: torch.ops.dflash_cuda.kv_proj(x, w, None)


def _topk():
    from dflash_ops.ops.select import row_topk
    z = _rand(7, 248320)
    return lambda: row_topk(z, 16)


def _select():
    from dflash_ops.ops.select import select_candidates
    v, k, rank, j = 248320, 16, 256, 7
    pred, succ = _rand(v, rank), _rand(v, rank)
    unary, cand = _rand(1, j, k), torch.randint(0, v, (1, j, k), device="cuda")
    hidden, anchor = _rand(1, j, rank), torch.randint(0, v, (1,), device="cuda")
    return lambda: select_candidates(unary, cand, hidden, anchor, pred, succ, 0.0)


CASES = {
    "proj_linear": (None, lambda: (lambda x, w: lambda: F.linear(x, w))(_rand(8, H2),
                                                                     _rand(1280, H2))),
    "proj_triton": (None, lambda: _triton_linear(_rand(8, H2), _rand(1280, H2))),
    "proj_splitk": (None, lambda: _splitk_linear(_rand(8, H2), _rand(1280, H2))),
    "o_cublas": (None, lambda: (lambda x, w: lambda: F.linear(x, w))(_rand(1, 4096),
                                                                  _rand(4096, 4096))),
    "o_triton": (None, lambda: _triton_linear(_rand(1, 4096), _rand(4096, 4096))),
    "conv_t8": ("grouped_dyn_conv", lambda: _conv(8)),
    "conv_t4096": ("grouped_dyn_conv", lambda: _conv(4096)),
    "convnorm_t8": ("conv_add_rms_norm_", lambda: _convnorm(8)),
    "convnorm_t4096": ("conv_add_rms_norm_", lambda: _convnorm(4096)),
    "ctxrms_t1": ("context_kv_", lambda: _ctxrms(1)),
    "ctxrms_t8": ("context_kv_", lambda: _ctxrms(8)),
    "ctxrms_t32": ("context_kv_", lambda: _ctxrms(32)),
    "skinny_o": (None, lambda: _skinny(1, 4096, 4096)),
    "skinny_qkv": (None, lambda: _skinny(1, 6144, 4096)),
    "skinny_proj2": (None, lambda: _skinny(8, 1280, H2)),
    "topk_b1": ("row_topk", _topk),
    "select_b1": ("select_candidates", _select),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--backend", default="cuda", help="for the op cases (default cuda)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_cases: needs a CUDA GPU", file=sys.stderr)
        return 2
    op, make = CASES[args.case]
    forced = dispatch.use_backend(args.backend, ops=(op,)) if op else None
    if forced:
        forced.__enter__()
    try:
        fn = make()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("ncu")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    finally:
        if forced:
            forced.__exit__(None, None, None)
    print(f"{args.case}: one launch profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
