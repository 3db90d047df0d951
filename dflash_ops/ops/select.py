"""DFlash 2's candidate selector walk: ``select_candidates``.

Per request r, mask row j < J of its block has unary scores ``unary [R, J, k]`` on candidate
tokens ``cand [R, J, k]`` (the top-k of that row's logits) and a projected hidden state
``hidden [R, J, rank]`` (the selector's ``hidden_projection``). Walking j = 0 .. J-1 from
``anchor [R]`` (the block's first token):

    score[r, j, i] = unary[r, j, i] + sum_d pred[prev, d] * hidden[r, j, d] * succ[cand[r, j, i], d]
    temperature 0: pick = argmax_i score (the first maximum; the first NaN if any, as
                   torch.argmax)
    temperature T > 0: q[r, j] = softmax(score / T); pick = the first i whose running sum of q
                       exceeds u[r, j] (given uniforms: graph-capturable, reproducible)
    prev = cand[r, j, pick];  path[r, j] = prev

with ``pred``/``succ`` the predecessor / successor codebooks ``[V, rank]``. Returns ``path [R, J]``
int64 and ``q [R, J, k]`` fp32 (one-hot at the pick when greedy): q is the draft distribution
that rejection sampling must use, on the k candidates. fp32 math throughout. A candidate or
anchor id outside [0, V) reads as a zero codebook row (its score is its unary score).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from . import _checks as C
from ._samples import META, Maker, rnd, set_, to

__all__ = ["select_candidates", "row_topk", "row_argmax"]  # (argmax_last: a helper, not an op)

_OP = "select_candidates"
_TOPK = "row_topk"
_ARGMAX = "row_argmax"
TOPK_MAX = 64  # the kernels' largest k (DFlash 2's top_k is 16)


def _check(unary, cand, hidden, anchor, pred, succ, temperature, u=None):
    op = _OP
    C.tensor(op, "unary", unary, rank=3, dtype=C.FLOAT_DTYPES, contiguous=True)
    r, j, k = unary.shape
    if k < 1 and r * j:
        C.fail(op, f"unary must have k >= 1 candidates a row (its last dim), got shape "
                   f"{list(unary.shape)}")
    if k > TOPK_MAX:  # row_topk's largest: no candidate list of the selector is longer
        C.fail(op, f"unary must have k <= {TOPK_MAX} candidates a row (its last dim, "
                   f"row_topk's largest k), got shape {list(unary.shape)}")
    dev = unary.device
    C.tensor(op, "cand", cand, shape=(r, j, k), dtype=torch.int64, device=dev, contiguous=True)
    C.tensor(op, "anchor", anchor, shape=(r,), dtype=torch.int64, device=dev, contiguous=True)
    C.tensor(op, "pred", pred, rank=2, dtype=C.FLOAT_DTYPES, device=dev, contiguous=True)
    rank = pred.shape[1]
    C.tensor(op, "succ", succ, shape=(pred.shape[0], rank), device=dev, contiguous=True)
    C.same_dtype(op, "succ", succ, "pred", pred)
    C.tensor(op, "hidden", hidden, shape=(r, j, rank), dtype=C.FLOAT_DTYPES, device=dev,
             contiguous=True)
    if not temperature >= 0:
        C.fail(op, f"temperature must be >= 0, got {temperature}")
    if temperature > 0:
        if u is None:
            C.fail(op, "u (uniforms [R, J]) is required when temperature > 0")
        C.tensor(op, "u", u, shape=(r, j), dtype=torch.float32, device=dev, contiguous=True)


def _rows(cb: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cb[ids] in fp32, zero rows for ids outside [0, V)."""
    if cb.shape[0] == 0:  # V = 0: every id is outside
        return torch.zeros(*ids.shape, cb.shape[1], dtype=torch.float32, device=cb.device)
    ok = (ids >= 0) & (ids < cb.shape[0])
    got = cb.float()[torch.where(ok, ids, torch.zeros_like(ids))]
    return torch.where(ok[..., None], got, torch.zeros_like(got))


def select_candidates_ref(unary, cand, hidden, anchor, pred, succ, temperature: float,
                          u: Optional[torch.Tensor] = None):
    r, j, k = unary.shape
    prev = anchor
    path, qs = [], []
    for pos in range(j):
        q_vec = _rows(pred, prev) * hidden[:, pos].float()  # [R, rank]
        score = unary[:, pos].float() + torch.einsum("rd,rkd->rk", q_vec,
                                                     _rows(succ, cand[:, pos]))
        if temperature > 0:
            q = torch.softmax(score / temperature, dim=-1)
            cdf = q.cumsum(-1)
            over = cdf > u[:, pos, None] * cdf[:, -1:]
            pick = torch.where(over.any(-1), over.float().argmax(-1),
                               torch.full_like(over[:, 0], k - 1, dtype=torch.long))
        else:
            pick = score.argmax(-1)
            q = torch.nn.functional.one_hot(pick, k).float()
        prev = cand[:, pos].gather(1, pick[:, None])[:, 0]
        path.append(prev)
        qs.append(q)
    if j == 0:
        return (torch.empty(r, 0, dtype=torch.long, device=unary.device),
                torch.empty(r, 0, k, dtype=torch.float32, device=unary.device))
    return torch.stack(path, 1), torch.stack(qs, 1)


def _fake(unary, cand, hidden, anchor, pred, succ, temperature, u=None):
    r, j, k = unary.shape
    return (unary.new_empty((r, j), dtype=torch.long),
            unary.new_empty((r, j, k), dtype=torch.float32))


# Default triton: 14.1 us at R 1, J 7, k 16, rank 256 on the H100 (session 43), the CUDA kernel
# (csrc/select.cu, the same walk) 59 us; the CUDA kernel refuses k / rank combinations it
# lacks registers for (Triton takes any k <= TOPK_MAX, any rank).
dispatch.define_op(
    "select_candidates(Tensor unary, Tensor cand, Tensor hidden, Tensor anchor, Tensor pred, "
    "Tensor succ, float temperature, Tensor? u=None) -> (Tensor, Tensor)",
    validate=_check, reference=select_candidates_ref, fake=_fake, default="triton")


# ----------------------------------------------------------------------------- row_topk
# The top-k of each logits row that the walk starts from: ``torch.topk``'s job, which on the
# H200 reads [7, 248320] bf16 at 1.4% of the copy bandwidth (58 us at one request, 870 us at
# 64; benchmarks/NOTES.md, session 15). Defined with a tie rule so that every backend returns
# the same candidates: the k largest values in descending order, equal values by ascending
# index (torch.topk leaves the order of ties unspecified).
def _check_topk(z, k):
    op = _TOPK
    C.tensor(op, "z", z, rank=2, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    if not isinstance(k, int) or not 1 <= k <= min(z.shape[1], TOPK_MAX):
        C.fail(op, f"k must be an int in [1, min(V, {TOPK_MAX})] = [1, "
                   f"{min(z.shape[1], TOPK_MAX)}] (V = z's last dim, {z.shape[1]}), got {k!r}")


def row_topk_ref(z, k: int):
    """(values [M, k] in z's dtype, indices [M, k] int64): a stable descending sort's first k
    (ties: the lower index first; NaN of either sign sorts above +inf).

    Sorted in fp32 with NaN made positive: CUDA's sort puts bf16 NaNs last and negative NaNs
    first (H200, torch 2.11), unlike the CPU's; the upcast is exact, so the order is z's."""
    zf = z.float()
    zf = torch.where(zf.isnan(), float("nan"), zf)
    idx = torch.sort(zf, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
    return torch.gather(z, 1, idx), idx


def _fake_topk(z, k):
    return z.new_empty((z.shape[0], k)), z.new_empty((z.shape[0], k), dtype=torch.long)


# Default triton (H100, session 43: 14.7 / 165 us at 7 / 448 rows of 248320, 4.1-5.4x faster
# than torch.topk); the CUDA kernel (csrc/select_topk.cu, the earlier chunk-max threshold
# algorithm) takes 27.5 / 207 us there.
dispatch.define_op("row_topk(Tensor z, int k) -> (Tensor, Tensor)", validate=_check_topk,
                   reference=row_topk_ref, fake=_fake_topk, default="triton")


def row_topk(z: torch.Tensor, k: int):
    """(values [M, k], indices [M, k] int64): the k largest entries of each row of z [M, V],
    descending, equal values by ascending index (every backend the same)."""
    return torch.ops.dflash.row_topk.default(z, int(k))


# ----------------------------------------------------------------------------- row_argmax
# The greedy token of each logits row: ``torch.argmax``'s job, which reads [15, 151936] bf16 in
# 11 us on the H200 (0.4 TB/s: a draft step's LM-head rows) and [960, 151936] in 168 us (1.7
# TB/s; benchmarks/NOTES.md, session 31). The same answer as torch.argmax, made explicit so
# that every backend returns it: the first index of the row's maximum, NaN above +inf (the
# first NaN wins), -0.0 equal to +0.0.
ARGMAX_MAX_V = 1 << 24  # the kernels merge a row's 4096-entry chunks in one program


def _check_argmax(z):
    op = _ARGMAX
    C.tensor(op, "z", z, rank=2, dtype=C.FLOAT_DTYPES, last_contiguous=True)
    if not 1 <= z.shape[1] <= ARGMAX_MAX_V:
        C.fail(op, f"z must have 1 to {ARGMAX_MAX_V} entries a row (its last dim), got shape "
                   f"{list(z.shape)}")


def row_argmax_ref(z):
    """[M] int64: the first index of each row's maximum, NaN above +inf (torch.argmax's
    answer, spelled out: the first NaN if the row has one, else the first maximum)."""
    zf = z.float()
    nan = zf.isnan()
    first_nan = nan.to(torch.uint8).argmax(-1)
    best = torch.where(nan, float("-inf"), zf).argmax(-1)
    return torch.where(nan.any(-1), first_nan, best)


def _fake_argmax(z):
    return z.new_empty((z.shape[0],), dtype=torch.long)


# Default triton, eager cuda (the C++ launch's lower host cost): neither measured yet against
# torch.argmax; the next GPU session's argmax_probe decides (benchmarks/NOTES.md, session 31).
dispatch.define_op("row_argmax(Tensor z) -> Tensor", validate=_check_argmax,
                   reference=row_argmax_ref, fake=_fake_argmax, default="triton", eager="cuda")


def row_argmax(z: torch.Tensor) -> torch.Tensor:
    """[M] int64: the first index of the maximum of each row of z [M, V] (NaN above +inf):
    torch.argmax(z, -1)'s answer from our kernels."""
    return torch.ops.dflash.row_argmax.default(z)


def argmax_last(z: torch.Tensor) -> torch.Tensor:
    """``z.argmax(-1)`` for a float z (bf16 / fp16 / fp32) of any rank >= 1 through
    ``row_argmax`` (z's rows flattened, copied first if the last dim is strided; the result has
    z's leading shape)."""
    v = z.shape[-1]
    z2 = z.reshape(-1, v)
    if z2.stride(-1) != 1 and z2.numel():
        z2 = z2.contiguous()
    return row_argmax(z2).view(z.shape[:-1])


def select_candidates(unary, cand, hidden, anchor, pred, succ, temperature: float = 0.0,
                      u: Optional[torch.Tensor] = None):
    """(path [R, J], q [R, J, k]): DFlash 2's selector walk over each row's candidates."""
    return torch.ops.dflash.select_candidates.default(unary, cand, hidden, anchor, pred, succ,
                                                      float(temperature), u)


def samples(device, dtype) -> dict:
    """Valid arguments per op, by case name, as {argument name: value} in schema order."""
    def case(seed, r, j, k, rank, v, temperature=0.0):
        m = Maker(seed, device, dtype)
        g = torch.Generator().manual_seed(seed)
        cand = torch.stack([torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(j)])
                            for _ in range(r)]).to(device)
        kw = dict(unary=m.rnd(r, j, k), cand=cand, hidden=m.rnd(r, j, rank),
                  anchor=torch.randint(0, v, (r,), generator=g).to(device),
                  pred=m.rnd(v, rank, scale=0.5), succ=m.rnd(v, rank, scale=0.5),
                  temperature=temperature)
        if temperature > 0:
            kw["u"] = torch.rand(r, j, generator=g).to(device)
        return kw

    def topk_case(seed, m, v, k, ties=False):
        z = Maker(seed, device, dtype).rnd(m, v)
        if ties:  # runs of equal values across the k-th place
            z = (z * 2).round() / 2
        return dict(z=z, k=k)

    return {_OP: {"greedy": case(40, 3, 7, 4, 8, 50),
                  "sampled": case(41, 2, 3, 16, 32, 100, temperature=0.7)},
            _TOPK: {"k16": topk_case(42, 5, 3000, 16), "ties-k5": topk_case(43, 3, 97, 5, True)},
            _ARGMAX: {"chunks": dict(z=topk_case(44, 3, 9000, 1)["z"]),
                      "ties": dict(z=topk_case(45, 4, 97, 1, True)["z"])}}


def bad_samples() -> dict:
    """Bad-input cases per op, as [(case name, mutation, argument the error names)]."""
    return {_OP: [
        ("unary-int", to("unary", dtype=torch.int32), "unary"),
        ("unary-rank-2", set_(unary=rnd(3, 4)), "unary"),
        ("unary-k-above-max", set_(unary=rnd(3, 7, TOPK_MAX + 1),
                                   cand=torch.zeros(3, 7, TOPK_MAX + 1, dtype=torch.long)),
         "unary"),
        ("unary-no-candidates", set_(unary=rnd(3, 7, 0), cand=torch.zeros(3, 7, 0,
                                                                          dtype=torch.long)),
         "unary"),
        ("cand-int32", to("cand", dtype=torch.int32), "cand"),
        ("cand-wrong-k", set_(cand=torch.zeros(3, 7, 5, dtype=torch.long)), "cand"),
        ("anchor-wrong-r", set_(anchor=torch.zeros(2, dtype=torch.long)), "anchor"),
        ("hidden-wrong-rank", set_(hidden=rnd(3, 7, 6)), "hidden"),
        ("succ-wrong-shape", set_(succ=rnd(49, 8)), "succ"),
        ("pred-device", to("pred", device=META), "pred"),
        ("temperature-negative", set_(temperature=-1.0), "temperature"),
        ("u-missing-when-sampling", set_(temperature=0.5), "u"),
    ], _TOPK: [
        ("z-int", to("z", dtype=torch.int32), "z"),
        ("z-rank-3", set_(z=rnd(2, 3, 40)), "z"),
        ("z-vocab-stride", set_(z=lambda kw: kw["z"].t().contiguous().t()), "z"),
        ("k-zero", set_(k=0), "k"),
        ("k-above-v", set_(k=3001), "k"),
        ("k-above-max", set_(k=TOPK_MAX + 1), "k"),
    ], _ARGMAX: [
        ("z-int", to("z", dtype=torch.int32), "z"),
        ("z-rank-1", set_(z=rnd(40)), "z"),
        ("z-vocab-stride", set_(z=lambda kw: kw["z"].t().contiguous().t()), "z"),
        ("z-empty-rows", set_(z=rnd(3, 0)), "z"),
    ]}
