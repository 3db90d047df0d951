"""The models' linear layers: cuBLAS (``F.linear``), our Triton GEMM or our CUDA skinny GEMM, per
shape.

``linear(x, w, b)`` computes ``x @ w^T + b`` like ``F.linear``. On CUDA, for bf16/fp16, it looks
up the GEMM's shape (N, K) and the bucket of M (rows) in ``TABLE`` and runs the Triton GEMM of
``kv_proj`` (``triton.context.kv_proj``) with the recorded launch config where a sweep measured
it faster than cuBLAS, in calls recorded into a CUDA graph; everywhere else (eager calls
included) it is ``F.linear``. The table is the sibling of the op table (``dispatch.define_op(
default=..., eager=...)``) and follows its rule: it holds kernel times under CUDA-graph replay,
and an eager Triton launch costs more host time (tens of microseconds) than these GEMMs take.

``linear(..., exact=True)`` (exact mode, CUDA bf16 / fp16) runs the Triton split-K GEMM with
one tile and one split of K per (N, K) for every M (``exact_config``), eager or captured, so a
row's result does not depend on how many rows share the call (cuBLAS picks its algorithm,
split-K included, by M): every output is the same fp32 sum of the same slice partials in slice
order. Only where the slices run changes with M: a program a slice while the tiles are too few
to fill the GPU (a one-row decode streams the weight on every SM), a program a tile summing
its slices in turn otherwise (no partials through memory). The tile may change with M too,
within the family whose bits depend on the slices alone (``exact_compatible``: wgmma tiles of
>= 64 rows, the same split and slice bounds; measured bit-equal on the H200 by
``benchmarks/exact_probe.py`` and checked again by the sweep that picks them): the table's
``exact`` entries give the fastest such launch per M bucket.

``TABLE`` comes from ``linear_table.json`` next to this file, written by
``benchmarks/sweep_linear.py --write-table`` from measurements on the H200 (each entry: the
config and both times; ``exact``: exact mode's fastest launch per shape and M bucket;
``holds_on``: other GPUs where end-to-end runs found the table faster than cuBLAS); without the
file, or on a GPU it does not name, every layer uses cuBLAS and exact mode its one default
launch. The choice depends on shapes only, so a captured graph replays with any
values.

A table entry whose cfg is ``["cuda"]`` (``CUDA_CFG``) runs the C++ ``kv_proj`` instead: at
1-32 rows on sm_90 its skinny kernel (csrc/context.cu: split-K over a thread-block cluster),
eager calls included (a C++ launch costs little host time), where the sweep measured it faster
than both cuBLAS and the best Triton launch.
"""
from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import dispatch, triton

TABLE_PATH = Path(__file__).with_name("linear_table.json")
M_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# exact mode's one tile (bm, bn, bk, gm, warps, stages, tma, persistent): 64 rows (the wgmma
# M at every call), no TMA (any strides and alignments), not persistent; session 21 measured it
# without a split (+107% on the iteration at 1 x 1k: 32-48 programs stream o_proj, down and
# qkv at one row); the split (exact_split) is not yet measured (issue 19)
EXACT_CFG = (64, 128, 64, 8, 4, 3, False, False)
EXACT_MAX_SPLIT = 8
EXACT_MIN_PROGRAMS = 256  # ~2 a SM on the H200's 132
EXACT_MIN_SLICE_STEPS = 4  # BLOCK_K steps a slice at least

CUDA_CFG = ("cuda",)  # a table entry for the C++ kv_proj (its skinny kernel)
SKINNY_MAX_ROWS = 8  # kv_proj's skinny kernel's rows by default (csrc/context.cu kSkinnyRows)

# (N, K) -> {m_bucket: ProjCfg fields (bm, bn, bk, gm, warps, stages, tma, persistent[, split[,
# serial]])}
# (split > 1: the split-K kernel: K in slices, the tile's last program sums the fp32 partials);
# exact mode's table: all ten fields (split and serial too)
Table = Dict[Tuple[int, int], Dict[int, tuple]]


def m_bucket(m: int) -> int:
    """The smallest bucket >= m (rows past the last bucket share it)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def parse_table(doc: dict) -> Table:
    """The JSON document ({"entries": [{"n", "k", "m", "cfg": [...], "triton_us",
    "cublas_us"}, ...]}) as a lookup table; only entries where Triton was faster."""
    table: Table = {}
    for e in doc.get("entries", []):
        cfg = e.get("cfg")
        if cfg is not None and list(cfg) == list(CUDA_CFG):  # the C++ skinny kernel's win
            if e.get("skinny_us") is not None and e["skinny_us"] < e["cublas_us"]:
                table.setdefault((int(e["n"]), int(e["k"])), {})[int(e["m"])] = CUDA_CFG
            continue
        if cfg is None or not e["triton_us"] < e["cublas_us"]:
            continue
        if len(cfg) not in (8, 9, 10):
            raise ValueError(f"{TABLE_PATH.name}: entry {e} needs an 8- to 10-field cfg "
                             f"(bm, bn, bk, gm, warps, stages, tma, persistent[, split[, "
                             f"serial]]), got {len(cfg)} fields")
        table.setdefault((int(e["n"]), int(e["k"])), {})[int(e["m"])] = tuple(cfg)
    return table


def parse_exact(doc: dict, strict: bool = False) -> Table:
    """The document's ``exact`` entries ({"n", "k", "m", "cfg": [10 ProjCfg fields], ...}) as
    a lookup table. An entry outside exact mode's family (``exact_compatible``: it would give
    a row other bits at that M), of another shape or of an M that is not a bucket is left out
    with a warning (a table written before a change of EXACT_CFG must not break every import
    of this module); ``strict``: a ValueError instead (test_shipped_table_loads)."""
    table: Table = {}
    for e in doc.get("exact", []):
        cfg, n, k, m = e.get("cfg"), int(e["n"]), int(e["k"]), int(e["m"])
        if cfg is None or len(cfg) != 10:
            why = ("needs a 10-field cfg (bm, bn, bk, gm, warps, stages, tma, persistent, "
                   f"split, serial), got {cfg}")
        elif m not in M_BUCKETS:
            why = f"M {m} is not a bucket of {M_BUCKETS}"
        else:
            why = exact_compatible(tuple(cfg), n, k)
        if why:
            msg = f"{TABLE_PATH.name}: exact entry for N {n}, K {k}, M {m}: {why}"
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + " (left out: exact mode's default launch runs there)")
            continue
        table.setdefault((n, k), {})[m] = tuple(cfg)
    return table


def table_gpus(doc: dict) -> Optional[Tuple[str, ...]]:
    """The GPUs a table document holds on: the one it was measured on (``env.gpu``) and those
    its ``holds_on`` entries name ({"gpu": name, "measured": how}: end-to-end runs that found
    the table faster there than cuBLAS everywhere); None: a table that names no GPU holds on
    any."""
    gpu = doc.get("env", {}).get("gpu")
    if gpu is None:
        return None
    return (gpu,) + tuple(h["gpu"] for h in doc.get("holds_on", []) if h["gpu"] != gpu)


def _load() -> Tuple[Table, Table, Optional[Tuple[str, ...]]]:
    if not TABLE_PATH.exists():
        return {}, {}, None
    with open(TABLE_PATH) as f:
        doc = json.load(f)
    return parse_table(doc), parse_exact(doc), table_gpus(doc)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_applies(device: torch.device) -> bool:
    """Whether the table's choices hold on ``device``: the GPU it was measured on, one its
    ``holds_on`` names, or any where the table names none."""
    if TABLE_GPUS is None:
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_name(index) in TABLE_GPUS


def choice(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
           graph: Optional[bool] = None) -> Optional[tuple]:
    """The Triton launch config for this GEMM, ``CUDA_CFG`` for the C++ skinny kernel, or None
    for cuBLAS; ``graph``: whether the call is recorded into a CUDA graph (default:
    ``dispatch.in_graph_call()``). Eager calls run cuBLAS where the table names a Triton
    launch (an eager Triton launch costs more host time than these GEMMs take on the GPU),
    the C++ kernel where it names that."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    cfg = TABLE.get((n, k), {}).get(m_bucket(m))
    if cfg is None or not table_applies(device):
        return None
    if cfg == CUDA_CFG:
        return cfg if m <= SKINNY_MAX_ROWS and dispatch.has_backend("kv_proj", "cuda") else None
    if not triton.AVAILABLE or not (dispatch.in_graph_call() if graph is None else graph):
        return None
    return cfg


def exact_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether exact mode's Triton GEMM runs here (CUDA, bf16 / fp16, triton); elsewhere
    ``linear(..., exact=True)`` is the torch path (on CPU, and fp32)."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and triton.AVAILABLE


def exact_split(n: int, k: int) -> int:
    """K slices of exact mode's GEMM for w [n, k]: from the shape alone (never M), doubled
    while the N tiles times the slices stay under EXACT_MIN_PROGRAMS and each slice keeps
    EXACT_MIN_SLICE_STEPS BLOCK_K steps (Qwen3-8B: o_proj and down 8, qkv 8, gate_up 2,
    the LM head 1)."""
    bn, bk = EXACT_CFG[1], EXACT_CFG[2]
    tiles_n, steps = -(-n // bn), -(-k // bk)
    split = 1
    while (split < EXACT_MAX_SPLIT and tiles_n * split < EXACT_MIN_PROGRAMS
           and steps >= 2 * split * EXACT_MIN_SLICE_STEPS):
        split *= 2
    return split


def _slice_len(k: int, split: int, bk: int) -> int:
    """The split-K kernel's slice length (triton.context.launch_proj: whole BLOCK_K steps)."""
    return -(-(-(-k // split)) // bk) * bk


def exact_compatible(cfg: tuple, n: int, k: int) -> Optional[str]:
    """Why the launch ``cfg`` (ProjCfg fields) cannot be exact mode's for w [n, k], or None if
    it can: exact_split's split, a wgmma tile of the sizes measured (64 / 128 rows, 64-256
    columns, 4 or 8 warps: each output a chain of k16 MMAs from zero a slice; 16-row tiles and
    other warp counts run mma.sync, not measured), the split-K kernel (at split 1
    its serial launch, as exact mode's default), BLOCK_K 64 or 128 with the default's slice
    bounds and no masked tail of its own. Within this family a row's bits are
    the split's alone (measured: benchmarks/exact_probe.py, session 25)."""
    bm, bn, bk, warps = cfg[0], cfg[1], cfg[2], cfg[4]
    split = cfg[8] if len(cfg) > 8 else 1
    want = exact_split(n, k)
    if split != want:
        return f"split {split}, exact mode's for this shape is {want}"
    if bm not in (64, 128) or bn not in (64, 128, 256):
        return f"tile {bm} x {bn} (measured: 64 / 128 rows x 64 / 128 / 256 columns)"
    if warps not in (4, 8):
        return f"{warps} warps (wgmma needs warp groups: 4 or 8)"
    if split == 1 and not (len(cfg) > 9 and cfg[9]):
        return "split 1 without serial (the plain GEMM kernel, not the split-K one)"
    if bk not in (64, 128):
        return f"BLOCK_K {bk} not 64 or 128"
    base = EXACT_CFG[2]
    if bk != base and (_slice_len(k, split, bk) != _slice_len(k, split, base) or k % bk):
        return f"BLOCK_K {bk} moves the slice bounds or the tail of K {k} (split {split})"
    return None


def exact_serial(m: int, n: int, k: int, split: int, sms: int) -> bool:
    """Whether exact mode sums a tile's slices in one program (True) or runs a program a slice
    (False): the one with the smaller modelled time, bytes over the fraction of the ``sms``
    SMs its programs fill (a program a slice also writes and reads the fp32 partials). The
    two give the same bits; this only picks the faster."""
    bm, bn = EXACT_CFG[0], EXACT_CFG[1]
    tiles = -(-m // bm) * -(-n // bn)
    if split == 1:
        return True
    weight = 2.0 * n * k
    partials = 8.0 * split * m * n  # fp32, written and read, rows past m skipped
    serial = weight / min(1.0, tiles / sms)
    parallel = (weight + partials) / min(1.0, tiles * split / sms)
    return serial <= parallel


def exact_config(m: int, n: int, k: int, device: torch.device):
    """Exact mode's launch for x [m, k] @ w [n, k]^T on ``device`` (a ProjCfg): the table's
    ``exact`` entry for M's bucket where the table holds on this GPU, else EXACT_CFG's tile,
    exact_split(n, k) slices, serial or not by exact_serial. Any of them gives the same bits."""
    from ..triton.context import ProjCfg  # here: triton may be absent off CUDA

    cfg = EXACT_TABLE.get((n, k), {}).get(m_bucket(m))
    if cfg is not None and table_applies(device):
        return ProjCfg(*cfg)
    return exact_default(m, n, k, device)


def exact_default(m: int, n: int, k: int, device: torch.device):
    """Exact mode's launch without the table: EXACT_CFG's tile, exact_split(n, k) slices,
    serial or not by exact_serial (the reference the sweep checks the table's members
    against)."""
    from ..triton.context import ProjCfg, sm_count  # here: triton may be absent off CUDA

    split = exact_split(n, k)
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return ProjCfg(*EXACT_CFG, split=split, serial=exact_serial(m, n, k, split, sms))


# the tables and the GPUs they hold on (the env's "gpu", torch.cuda.get_device_name, and the
# document's "holds_on"): their configs are the H200's winners, also faster than cuBLAS end to
# end on the H100 (session 32); on another GPU every layer runs cuBLAS and exact mode its
# default launch (an H200 split-K or tile choice can lose to cuBLAS elsewhere, and sm_80 has
# no TMA)
TABLE, EXACT_TABLE, TABLE_GPUS = _load()


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
           exact: bool = False) -> torch.Tensor:
    """``x @ w^T + b`` as one 2-D GEMM over the rows of x (any leading shape). A leading shape
    that does not flatten to rows without a copy (e.g. ``h.view(R, B, H)[:, 1:]``) is copied
    first: ``F.linear`` would run it as a batched GEMM that reads w once per leading index
    (measured: the drafter's LM head at batch 8 took 2.4 ms instead of 0.3 ms). ``exact``: the
    row-count-independent GEMM of exact mode (module docstring)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, k) = x2.shape[0], w.shape
    cfg = None
    if m and w.dtype == x.dtype and (b is None or b.dtype == x.dtype):
        if exact:
            cfg = exact_config(m, n, k, x.device) if exact_runs(x.dtype, x.device) else None
        else:
            cfg = choice(m, n, k, x.dtype, x.device)
    if cfg is None:
        return F.linear(x2, w, b).view(*lead, n)
    if cfg == CUDA_CFG:
        return torch.ops.dflash_cuda.kv_proj(x2, w, b).view(*lead, n)
    from ..triton.context import ProjCfg, kv_proj  # here: triton may be absent off CUDA

    return kv_proj(x2, w, b, cfg=ProjCfg(*cfg)).view(*lead, n)


def _forced_off(op: str) -> bool:
    """Whether a backend other than triton is forced for ``op``: the models then run the op
    itself, not a Triton GEMM epilogue standing in for it (exact mode's ``graph_backends``
    forces triton, the graph default, and keeps the epilogues)."""
    return dispatch.forced_backend(op) not in (None, "triton")


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """``silu_mul(linear(x, w, None, exact))`` for a gate | up weight w [2I, H] (gate rows, then
    up rows): [..., I]. Where ``linear`` would run the table's Triton GEMM without a K split
    (calls recorded into a CUDA graph, bf16 / fp16), one launch computes the SwiGLU in that
    GEMM's epilogue (``triton.context.glu_proj`` with half the N tile, so a program streams
    the same weight bytes): the [.., 2I] output never goes to memory and silu_mul's launch is
    gone. Elsewhere (eager calls, cuBLAS or split-K entries, N tiles under 32, exact mode, CPU,
    a backend other than triton forced for silu_mul) the two calls. The fused result has the
    bits of the GEMM with half the table's N tile, then silu_mul (the table's own tile may
    round otherwise)."""
    if not exact and x.dim() >= 1 and x.shape[-1] == w.shape[1] and w.dtype == x.dtype:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m, (n, k) = x2.shape[0], w.shape
        cfg = choice(m, n, k, x.dtype, x.device) if m and n % 2 == 0 else None
        if cfg is not None and cfg != CUDA_CFG:
            from ..triton.context import ProjCfg, glu_proj, glu_tile  # triton may be absent

            pc = ProjCfg(*cfg)
            if (pc.split == 1 and not pc.serial and pc.bn >= 32
                    and not _forced_off("silu_mul")):
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                return glu_proj(x2, w, cfg=glu_tile(pc)).view(*lead, n // 2)
    return torch.ops.dflash.silu_mul(linear(x, w, None, exact))


def o_proj_norm_silu_mul(attn: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor],
                         residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         w_gu: torch.Tensor, exact: bool = False) -> Optional[torch.Tensor]:
    """A decoder layer's o_proj, residual add, post-attention RMSNorm and SwiGLU in two launches,
    where the table runs both o_proj and gate | up on the Triton GEMM (graphed calls) and
    gate | up without a K split: ``residual += attn @ w_o^T + b_o`` in o_proj's epilogue, which
    also writes the row scaled by the norm's weight and the row's sums of squares by tile
    (``triton.context.proj_add_norm_``); gate | up applies the row's rstd in its epilogue
    before the SwiGLU (``glu_proj(rstd=...)``). Returns silu(gate) * up [T, I], or None where
    it does not apply (the caller runs linear, fused_add_rms_norm_, linear_silu_mul; also while
    a backend other than triton is forced for either op). Not bit-identical to that chain (the
    GEMM reads the row rounded once, T(x * w), where the chain rounds T(T(x * rstd) * w), and
    rstd scales the fp32 sum): within the tolerance rule; exact mode never folds."""
    if exact or attn.dim() != 2 or not attn.shape[0]:
        return None
    m, (n, k), dt = attn.shape[0], w_o.shape, attn.dtype
    if (residual.shape != (m, n) or not residual.is_contiguous() or residual.dtype != dt
            or w_o.dtype != dt or w_gu.dtype != dt or (b_o is not None and b_o.dtype != dt)
            or norm_weight.shape != (n,) or w_gu.shape[1] != n or w_gu.shape[0] % 2):
        return None
    co = choice(m, n, k, dt, attn.device)
    cg = choice(m, w_gu.shape[0], n, dt, attn.device)
    if co is None or cg is None or co == CUDA_CFG or cg == CUDA_CFG:
        return None
    from ..triton.context import ProjCfg, glu_proj, glu_tile, proj_add_norm_

    pg = ProjCfg(*cg)
    if (pg.split > 1 or pg.serial or pg.bn < 32 or _forced_off("silu_mul")
            or _forced_off("fused_add_rms_norm_")):
        return None
    x = attn if attn.stride(-1) == 1 else attn.contiguous()
    u, ss = proj_add_norm_(x, w_o, b_o, residual, norm_weight.contiguous(), cfg=ProjCfg(*co))
    return glu_proj(u, w_gu, cfg=glu_tile(pg), rstd=(ss, eps))
