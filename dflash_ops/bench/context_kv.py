"""Context K/V suite: ``knorm_rope_``, ``qk_norm_rope_`` and ``store_kv_`` standalone
(``bench.context_ops``), and the full context K/V path ``context_kv_`` (GEMM + K-norm + RoPE +
paged cache writes, ``bench.context_fused``), our backends against the baselines; then the host
overhead of an eager call of each op of the K/V path.

Tables (``TABLES``): knorm_rope_, qk_norm_rope_, qk_norm_rope_store_, store_kv_ (per model of ``context_ops.MODELS``),
context_kv_ (per model of ``context_fused.CTX_MODELS``), context_kv_hidden_norm (Qwen3-8B at
QUICK_TS), host. T = 1 ... 16384 tokens (``--quick``: QUICK_TS), bf16; shapes, columns, bytes
and checks are in those modules' docstrings.

The host table (Qwen3-8B drafter shapes, T = 16; context_kv_ and kv_proj at H = 4096): one row
per op (knorm_rope_, qk_norm_rope_, rope_, store_kv_, kv_proj, context_kv_): the host time of an
eager call with the op's default backend, next to each backend forced (not the torch reference
of store_kv_ / context_kv_, which synchronises); then one aten kernel for calibration. Alone
(``--tables host``) it takes seconds (no floors are measured then).

Options (``dflash-ops bench context_kv ...`` or ``benchmarks/bench_context_kv.py``): ``--models``
(comma-separated names of MODELS / CTX_MODELS) restricts the models, ``--tables`` the tables,
``--compiled-chain`` / ``--no-compiled-chain`` runs / drops the compiled-chain column of the
context_kv_ tables (default: run, except under ``--quick``). A restricted run writes
``context_kv-<models>[-<tables>].md/.json/.png`` (e.g. ``context_kv-Qwen3-8B.md``,
``context_kv-Qwen3-8B-context_kv_.md``), so it never overwrites a fuller one.

Run time on the H200 (estimates): the standalone tables and the host table of both models ~10
minutes, ``--quick`` ~half. The context_kv_ tables: ~2-4 minutes a model (7 T x 7 columns, ~2 s
a T of timing at T <= 1024, more at T = 16384; the first Triton JIT compiles; the compiled
chain, one torch.compile per T, 10-25 s each, the largest part), so ~10-17 minutes for the four
models and the hidden_norm table; ``--quick`` (4 T, no compiled chain, shorter timing) ~1 minute
a model. Memory: at most ~5 GB at T = 16384 (rotating sets, the caches, a pristine copy, the
reference's caches and its fp32 GEMM, one column's copy).
"""
from __future__ import annotations

import argparse

import torch

from ..ops.rope import make_cos_sin_cache
from .columns import Impl, backend_host_table, host_table
from .context_fused import CTX_MODELS, CTX_NOTES, HN_MODEL, ctx_tables
from .context_ops import (BLOCK_SIZE, DEVICE, EPS, HQ, MAX_POS, MODELS, OP_NOTES, cache_views,
                          op_tables, random_positions, rnd, split_qkv)
from .harness import Results, measure_floors, name_list

TABLES = ("knorm_rope_", "qk_norm_rope_", "qk_norm_rope_store_", "store_kv_", "context_kv_",
          "context_kv_hidden_norm", "host")
ALL_MODELS = tuple(dict.fromkeys([*MODELS, *CTX_MODELS]))
TS = (1, 16, 64, 256, 1024, 4096, 16384)
QUICK_TS = (1, 256, 4096, 16384)
HOST_T = 16


def _host_tables(res: Results) -> None:
    """Host time per eager call of each op of the K/V path, Qwen3-8B shapes at T = HOST_T."""
    n_layers, hkv, d = MODELS["Qwen3-8B"]
    h = CTX_MODELS["Qwen3-8B"][0]
    t = HOST_T
    cache = make_cos_sin_cache(MAX_POS, d, device=DEVICE)
    pos = random_positions(t)
    kv = rnd(t, n_layers, 2, hkv, d)
    qkv = rnd(t, (HQ + 2 * hkv) * d)
    q, k = split_qkv(qkv, hkv, d)
    wk, wq, wk1 = 1 + 0.5 * rnd(n_layers, d), 1 + 0.5 * rnd(d), 1 + 0.5 * rnd(d)
    kcs, vcs = cache_views([rnd(2, 2, BLOCK_SIZE, hkv, d) for _ in range(n_layers)])
    slots = torch.randperm(2 * BLOCK_SIZE, device=DEVICE)[:t]
    x, w_kv = rnd(t, h), rnd(n_layers * 2 * hkv * d, h) * h ** -0.5
    ops = torch.ops.dflash
    calls = {
        "knorm_rope_": lambda: ops.knorm_rope_.default(kv[:, :, 0], wk, pos, cache, EPS, True),
        "qk_norm_rope_": lambda: ops.qk_norm_rope_.default(q, k, wq, wk1, pos, cache, EPS, True),
        "rope_": lambda: ops.rope_.default(q, pos, cache, True),
        "store_kv_": lambda: ops.store_kv_.default(kv[:, :, 0], kv[:, :, 1], kcs, vcs, slots),
        "kv_proj": lambda: ops.kv_proj.default(x, w_kv, None),
        "context_kv_": lambda: ops.context_kv_.default(x, w_kv, None, wk, pos, cache, slots, kcs,
                                                       vcs, EPS, True, None),
    }
    backend_host_table(
        res, f"host overhead per eager call (us), default backend vs forced: T={t}, "
             f"L={n_layers}, Hkv={hkv}, D={d}, Hq={HQ}, H={h} bf16", calls,
        syncs=("store_kv_", "context_kv_"))
    host_table(res, "host overhead per eager call, calibration", [
        Impl("(calibration) x.mul(2): one aten kernel", lambda: kv.mul(2), None)])


def add_options(p) -> None:
    p.add_argument("--models", type=name_list(ALL_MODELS, "models"), default=None,
                   metavar="M1,M2", help=f"models (default all of {', '.join(ALL_MODELS)})")
    p.add_argument("--tables", type=name_list(TABLES, "tables"), default=None, metavar="T1,T2",
                   help=f"tables (default all of {', '.join(TABLES)})")
    p.add_argument("--compiled-chain", action=argparse.BooleanOptionalAction, default=None,
                   help="the context_kv_ tables' torch.compile column (default: on, off with "
                        "--quick)")


def run(quick: bool = False, models=None, tables=None, compiled_chain=None) -> Results:
    """Measure floors, then the tables; returns the Results (the caller prints and writes).
    ``models`` / ``tables``: names of ALL_MODELS / TABLES (default all); ``compiled_chain``:
    the compiled-chain column (None: not under ``quick``)."""
    models, tables = models or list(ALL_MODELS), tables or list(TABLES)
    compiled_chain = not quick if compiled_chain is None else compiled_chain
    floors = measure_floors() if set(tables) - {"host"} else {}  # the host tables need none
    # a restricted run gets its own result files, never overwriting a fuller run's
    suffix = "" if len(models) == len(ALL_MODELS) else "-" + "-".join(models)
    suffix += "" if len(tables) == len(TABLES) else "-" + "-".join(tables)
    res = Results("context_kv" + suffix, floors=floors)
    timing = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=25, rep_ms=100)
    ts = QUICK_TS if quick else TS
    with torch.no_grad():
        for model in models:
            if model in MODELS:
                op_tables(res, model, ts, timing, tables)
            if model in CTX_MODELS and "context_kv_" in tables:
                ctx_tables(res, model, ts, timing, hidden_norm=False,
                           compiled_chain=compiled_chain)
            if model == HN_MODEL and "context_kv_hidden_norm" in tables:
                ctx_tables(res, model, QUICK_TS, timing, hidden_norm=True,
                           compiled_chain=compiled_chain)
        if "host" in tables:
            _host_tables(res)
    res.notes += [
        "timing: median per call of CUDA-graph replays (>= 32 calls a graph) at every size; "
        "do_bench events only where capture fails or the column synchronises (said in the note); "
        "inputs rotate over sets totalling >= 2x L2 (<= 1024 sets)",
    ]
    if {"knorm_rope_", "qk_norm_rope_", "qk_norm_rope_store_", "store_kv_"} & set(tables):
        res.notes += OP_NOTES
    if {"context_kv_", "context_kv_hidden_norm"} & set(tables):
        res.notes += CTX_NOTES
    if "host" in tables:
        res.notes.append("host us: CPU time to issue one eager call while the GPU is kept busy "
                         "(see dflash_ops.bench.harness.host_overhead_us); 'default': the backend "
                         "a call gets with nothing forced, the other columns that backend forced "
                         "with use_backend")
    return res
