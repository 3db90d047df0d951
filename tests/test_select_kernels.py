"""``select_candidates`` (DFlash 2's candidate selector walk).

Greedy: the torch reference's path equals the ``dflash`` package's ``CandidateSelector.select``
on its own random weights. Sampled: q is softmax(score / T) of the scores written out in float64,
and the draws follow q (chi-square over many uniforms). The Triton kernel against the reference
under TRITON_INTERPRET=1 (fp32 / fp16; k and rank not powers of two; candidate and anchor ids
outside the vocabulary) and on the GPU.

``row_topk`` and ``row_argmax``: the references against torch.topk / torch.argmax, the kernels
against the references, bit for bit, on ties, infinities, signed zeros and NaNs.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import run_interpreted

from dflash_ops import dispatch
from dflash_ops.ops.select import (ARGMAX_MAX_V, TOPK_MAX, argmax_last, row_argmax,
                                   row_argmax_ref, row_topk, row_topk_ref, select_candidates,
                                   select_candidates_ref)


def case(r, j, k, rank, v, temperature=0.0, dtype=torch.float32, seed=0, device="cpu",
         bad_ids=False, mixed=False, nans=False, big_anchor=False):
    """``mixed``: unary fp32 (torch.topk of fp32 logits) and hidden fp16 beside codebooks of
    ``dtype``: each of the three may have its own float dtype. ``nans``: NaN unary scores (one
    beside a +inf, two in a row, a row all NaN): greedy picks the first NaN, as torch.argmax."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(j)])
                        for _ in range(r)])
    anchor = torch.randint(0, v, (r,), generator=g)
    if bad_ids:
        cand[0, 0, 0] = v + 3
        cand[-1, -1, -1] = -2
        anchor[0] = -1
    if big_anchor:  # an anchor id past the codebooks: a zero predecessor row, as -1
        anchor[-1] = v
    unary = torch.randn(r, j, k, generator=g)
    if nans:
        unary[0, 0, 1], unary[0, 0, 2] = float("inf"), float("nan")
        unary[0, 1, 3], unary[0, 1, 1] = float("nan"), float("nan")
        unary[-1, -1, :] = float("nan")
    kw = dict(unary=unary.to(device, torch.float32 if mixed else dtype),
              cand=cand.to(device),
              hidden=torch.randn(r, j, rank, generator=g).to(device,
                                                             torch.float16 if mixed else dtype),
              anchor=anchor.to(device),
              pred=(torch.randn(v, rank, generator=g) * 0.5).to(device, dtype),
              succ=(torch.randn(v, rank, generator=g) * 0.5).to(device, dtype),
              temperature=temperature)
    if temperature > 0:
        kw["u"] = torch.rand(r, j, generator=g).to(device)
    return kw


def test_greedy_path_is_the_dflash_packages():
    transformers = pytest.importorskip("transformers")
    dm = pytest.importorskip("dflash.model")
    cfg = transformers.Qwen3Config(hidden_size=32, vocab_size=60,
                                   dflash_config={"selector_rank": 8, "selector_top_k": 5})
    torch.manual_seed(0)
    sel = dm.CandidateSelector(cfg)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn_like(p))
        hidden, logits = torch.randn(3, 6, 32), torch.randn(3, 6, 60)
        anchor = torch.randint(0, 60, (3,))
        want, _, _ = sel.select(hidden, logits, anchor, 0.0)
        unary, cand = torch.topk(logits, 5, dim=-1)
        path, q = select_candidates_ref(unary, cand, sel.hidden_projection(hidden), anchor,
                                        sel.predecessor_codebook.weight,
                                        sel.successor_codebook.weight, 0.0)
    assert torch.equal(path, want)
    assert torch.equal(q.sum(-1), torch.ones(3, 6))


def test_sampled_q_is_the_softmax_of_the_scores():
    kw = case(2, 3, 6, 8, 40, temperature=0.7, seed=1)
    path, q = select_candidates_ref(**kw)
    prev = kw["anchor"]
    for j in range(3):
        pv = kw["pred"].double()[prev] * kw["hidden"].double()[:, j]
        score = kw["unary"].double()[:, j] + torch.einsum(
            "rd,rkd->rk", pv, kw["succ"].double()[kw["cand"][:, j]])
        want = torch.softmax(score / 0.7, -1)
        torch.testing.assert_close(q[:, j].double(), want, atol=1e-6, rtol=1e-6)
        prev = path[:, j]
        assert bool((kw["cand"][:, j] == prev[:, None]).any(-1).all())


def test_sampled_draws_follow_q():
    """One request, one row, 4000 uniforms: the picks' counts against q (chi-square, p > 1e-3)."""
    n, k = 4000, 6
    kw = case(1, 1, k, 8, 30, temperature=1.3, seed=2)
    kw = {a: (b.expand(n, *b.shape[1:]).contiguous() if isinstance(b, torch.Tensor)
              and a != "pred" and a != "succ" else b) for a, b in kw.items()}
    kw["u"] = torch.rand(n, 1, generator=torch.Generator().manual_seed(3))
    path, q = select_candidates_ref(**kw)
    counts = torch.stack([(path[:, 0] == c).sum() for c in kw["cand"][0, 0]]).double()
    expected = q[0, 0].double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # chi-square with k - 1 = 5 degrees of freedom: P(chi2 > 20.5) = 1e-3
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())


GRID = [dict(r=3, j=7, k=4, rank=8, v=50), dict(r=2, j=3, k=20, rank=33, v=100),
        dict(r=1, j=1, k=1, rank=4, v=9), dict(r=4, j=5, k=16, rank=64, v=300, bad_ids=True),
        dict(r=2, j=4, k=6, rank=16, v=40, nans=True),
        dict(r=2, j=1, k=7, rank=16, v=60, big_anchor=True),  # one row: the anchor only
        dict(r=1, j=3, k=40, rank=20, v=200)]  # k 40: a 64-wide candidate tile


# the CUDA kernel's (dims a lane, candidates a warp) variants: rank 8-512, k 1-32
GPU_GRID = GRID + [dict(r=2, j=7, k=16, rank=256, v=1000), dict(r=3, j=4, k=8, rank=512, v=700),
                   dict(r=2, j=6, k=32, rank=128, v=500), dict(r=1, j=15, k=9, rank=100, v=64),
                   dict(r=3, j=7, k=16, rank=256, v=900, mixed=True),
                   dict(r=2, j=40, k=32, rank=128, v=700),  # ids past the kernel's smem copy
                   dict(r=2, j=5, k=TOPK_MAX, rank=256, v=500)]  # the largest k


def check_backend(device, dtypes, backend="triton", grid=GRID):
    for dtype in dtypes:
        for i, g in enumerate(grid):
            for temperature in (0.0, 0.8):
                kw = case(**g, temperature=temperature, dtype=dtype, seed=10 + i, device=device)
                want = select_candidates_ref(**kw)
                with dispatch.use_backend(backend, ops=("select_candidates",)):
                    got = select_candidates(**kw)
                what = f"{backend} {dtype} {g} T={temperature}"
                assert torch.equal(got[0], want[0]), what
                torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5,
                                           equal_nan=bool(g.get("nans")),
                                           msg=lambda m: f"{what}: {m}")


_SCRIPT = r"""
import torch
import tests.test_select_kernels as t
t.check_backend("cpu", (torch.float32, torch.float16))
print("interp-ok")
"""


def test_triton_kernel_under_interpreter():
    run_interpreted(_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernels_gpu(backend):
    if not dispatch.has_backend("select_candidates", backend):
        pytest.fail(f"no {backend} kernel for select_candidates (is dflash_ops._C built?)")
    grid = GPU_GRID
    if backend == "cuda":  # the k 40 / 64 cases are the triton kernel's alone
        grid = [g for g in GPU_GRID if cuda_takes(g)]
        assert len(grid) < len(GPU_GRID)
    check_backend("cuda", (torch.float32, torch.bfloat16), backend, grid)


def cuda_takes(g):
    """The CUDA kernel's shapes (its error message's three variants)."""
    k, rank = g["k"], g["rank"]
    return (k <= 8 and rank <= 512) or (k <= 16 and rank <= 256) or (k <= 32 and rank <= 128)


@pytest.mark.gpu
def test_cuda_kernel_refuses_shapes_it_lacks():
    for k, rank in ((32, 256), (40, 20), (TOPK_MAX, 256)):
        kw = case(1, 2, k, rank, 300, device="cuda")
        with dispatch.use_backend("cuda", ops=("select_candidates",)):
            with pytest.raises(ValueError, match=f"k <= 16 with rank <= 256.*got k = {k}"):
                select_candidates(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_graph_replay_gpu(backend):
    """Captured once in a CUDA graph (sampled: the uniforms are an input), replayed on new
    inputs copied into the same buffers."""
    kw = case(4, 5, 16, 64, 300, temperature=0.8, device="cuda")
    static = dict(kw)
    with dispatch.use_backend(backend, ops=("select_candidates",)):
        select_candidates(**static)  # warm-up: compile before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            path, q = select_candidates(**static)
    for seed in (1, 2):
        new = case(4, 5, 16, 64, 300, temperature=0.8, device="cuda", seed=seed)
        for k in ("unary", "cand", "hidden", "anchor", "pred", "succ", "u"):
            static[k].copy_(new[k])
        g.replay()
        want = select_candidates_ref(**static)
        assert torch.equal(path, want[0])
        torch.testing.assert_close(q, want[1], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- row_topk
def topk_case(m, v, k, ties=False, dtype=torch.float32, seed=0, device="cpu", infs=False,
              flat=False, zeros=False, nans=False, fill=None):
    g = torch.Generator().manual_seed(seed)
    z = torch.zeros(m, v) if flat else torch.randn(m, v, generator=g)  # flat: every entry ties
    if nans:  # NaN of either sign sorts above +inf (a +inf at a lower index comes after it)
        z[0, 1] = float("inf")
        z[0, 3], z[0, v - 2] = float("nan"), -float("nan")
    if zeros:  # the best entries are zeros of both signs, which tie (-0.0 == 0.0)
        z = -z.abs() - 1
        z[:, ::7] = -0.0
        z[:, 3::7] = 0.0
    if ties:  # many equal values, across the k-th place too
        z = (z * 2).round() / 2
    if infs:
        z[0, v // 2] = float("inf")
        z[-1, : min(v, 5)] = float("-inf")
    if fill is not None:  # a whole row of one value (NaN, -inf): every entry ties
        z[0] = fill
    return z.to(device, dtype), k


def test_topk_reference_is_torch_topk_with_ties_by_index():
    z, _ = topk_case(4, 300, 9, seed=1)
    vals, idx = row_topk_ref(z, 9)
    want = torch.topk(z, 9, dim=-1)
    assert torch.equal(vals, want.values) and torch.equal(idx, want.indices)  # no ties
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    vals, idx = row_topk_ref(z, 4)
    assert idx.tolist() == [[1, 2, 4, 5]] and vals.tolist() == [[3.0, 3.0, 3.0, 2.0]]


TOPK_GRID = [dict(m=3, v=97, k=5, ties=True), dict(m=2, v=5000, k=16),
             dict(m=1, v=16, k=16, infs=True), dict(m=4, v=2049, k=TOPK_MAX),
             dict(m=2, v=4100, k=7, ties=True, infs=True), dict(m=1, v=1, k=1),
             # more chunks than k: only the k best chunks are read again (ties across them too)
             dict(m=2, v=40000, k=5), dict(m=2, v=30000, k=3, ties=True, infs=True),
             dict(m=1, v=20000, k=4, flat=True), dict(m=2, v=9000, k=6, zeros=True),
             dict(m=2, v=30000, k=4, nans=True),
             # k > 16 with more chunks than k: 640 candidates, the merge's 4-warp width
             dict(m=2, v=50000, k=20, ties=True),
             dict(m=2, v=5000, k=6, fill=float("nan")), dict(m=2, v=5000, k=6, fill=-float("inf"))]
GPU_TOPK_GRID = TOPK_GRID + [dict(m=7, v=248320, k=16), dict(m=56, v=151936, k=16, ties=True),
                             dict(m=3, v=248320, k=TOPK_MAX), dict(m=3, v=151936, k=33, ties=True)]


def check_topk(device, dtypes, grid=TOPK_GRID, backend="triton"):
    for dtype in dtypes:
        for i, g in enumerate(grid):
            z, k = topk_case(**g, dtype=dtype, seed=20 + i, device=device)
            want = row_topk_ref(z, k)
            with dispatch.use_backend(backend, ops=("row_topk",)):
                got = row_topk(z, k)
            what = f"row_topk {backend} {dtype} {g}"
            assert torch.equal(got[1], want[1]), what
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True,
                                       msg=what)  # the same bits (NaN where NaN)


_TOPK_SCRIPT = r"""
import torch
import tests.test_select_kernels as t
t.check_topk("cpu", (torch.float32, torch.float16))
print("interp-ok")
"""


def test_topk_triton_kernel_under_interpreter():
    run_interpreted(_TOPK_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_topk_kernel_gpu(backend):
    if not dispatch.has_backend("row_topk", backend):
        pytest.fail(f"no {backend} kernel for row_topk (is dflash_ops._C built?)")
    check_topk("cuda", (torch.float32, torch.bfloat16, torch.float16), GPU_TOPK_GRID, backend)
    # a strided z (rows of a wider buffer, the LM head's logits view)
    wide = torch.randn(5, 3000, device="cuda")
    z = wide[:, 7:2999]
    with dispatch.use_backend(backend, ops=("row_topk",)):
        got = row_topk(z, 9)
    want = row_topk_ref(z, 9)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_topk_graph_replay_gpu(backend):
    z, k = topk_case(14, 248320, 16, device="cuda", dtype=torch.bfloat16)
    with dispatch.use_backend(backend, ops=("row_topk",)):
        row_topk(z, k)  # compile before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            vals, idx = row_topk(z, k)
    for seed in (1, 2):
        z.copy_(topk_case(14, 248320, 16, device="cuda", dtype=torch.bfloat16, seed=seed)[0])
        g.replay()
        want = row_topk_ref(z, k)
        assert torch.equal(idx, want[1]) and torch.equal(vals, want[0])


# ----------------------------------------------------------------------------- row_argmax
def test_argmax_reference_is_torch_argmax():
    for i, g in enumerate(TOPK_GRID):
        z, _ = topk_case(**g, seed=60 + i)
        assert torch.equal(row_argmax_ref(z), z.argmax(-1)), g  # CPU torch.argmax: NaN wins
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0],           # ties: the first maximum
                      [-0.0, 0.0, -1.0, -0.0],        # signed zeros tie
                      [float("-inf")] * 4,            # every entry -inf: index 0
                      [2.0, float("inf"), float("nan"), float("nan")],  # the first NaN
                      [float("nan"), 1.0, float("inf"), 0.0]])
    assert row_argmax_ref(z).tolist() == [1, 0, 0, 2, 0]
    assert row_argmax_ref(z.to(torch.bfloat16)).tolist() == [1, 0, 0, 2, 0]
    assert row_argmax_ref(torch.empty(0, 5)).shape == (0,)
    assert argmax_last(torch.randn(2, 3, 7)).shape == (2, 3)  # leading dims kept
    zt = torch.randn(50, 7).t()  # a strided last dim: copied first
    assert torch.equal(argmax_last(zt), zt.argmax(-1))
    assert argmax_last(torch.randn(0, 15, 10)).shape == (0, 15)  # no rows (an empty batch)


def test_argmax_rejects_too_wide_rows():
    z = torch.empty(1, ARGMAX_MAX_V + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"row_argmax.*\bz\b.*1 to"):
        row_argmax(z)


ARGMAX_GRID = [dict(m=3, v=97, k=1, ties=True), dict(m=2, v=5000, k=1),
               dict(m=1, v=16, k=1, infs=True), dict(m=4, v=4096, k=1),  # one whole chunk
               dict(m=2, v=4097, k=1, ties=True, infs=True), dict(m=1, v=1, k=1),
               dict(m=5, v=3000, k=1),  # several rows of one chunk each
               dict(m=2, v=40000, k=1), dict(m=3, v=30000, k=1, ties=True, infs=True),
               dict(m=1, v=20000, k=1, flat=True),  # every entry ties: index 0
               dict(m=2, v=9000, k=1, zeros=True), dict(m=2, v=30000, k=1, nans=True),
               dict(m=6, v=12289, k=1)]  # one entry into a fourth chunk
GPU_ARGMAX_GRID = ARGMAX_GRID + [dict(m=15, v=151936, k=1), dict(m=1, v=151936, k=1),
                                 dict(m=64, v=248320, k=1, ties=True),
                                 dict(m=960, v=151936, k=1, ties=True)]


def argmax_case(g, dtype, seed, device):
    """topk_case's rows, each with its maximum moved to a column of its own (random per row, the
    last column and the first of the last chunk among them) and, in every other row, tied at a
    second random column: the first of the two must win wherever they fall."""
    z, _ = topk_case(**g, dtype=dtype, seed=seed)
    m, v = z.shape
    if v > 2 and not g.get("flat") and not g.get("nans"):
        gen = torch.Generator().manual_seed(seed + 1000)
        top = (z.float().max() + 1).to(z.dtype)
        cols = torch.randint(0, v, (m,), generator=gen)
        cols[0] = v - 1
        if m > 1:
            cols[1] = (v - 1) // 4096 * 4096
        for r in range(m):
            z[r, cols[r]] = top
            if r % 2:
                z[r, torch.randint(0, v, (1,), generator=gen)] = top
    return z.to(device)


def check_argmax(device, dtypes, grid=ARGMAX_GRID, backend="triton"):
    for dtype in dtypes:
        for i, g in enumerate(grid):
            z = argmax_case(g, dtype, 70 + i, device)
            want = row_argmax_ref(z)
            with dispatch.use_backend(backend, ops=("row_argmax",)):
                got = row_argmax(z)
            assert got.dtype == torch.long and got.shape == (z.shape[0],)
            assert torch.equal(got, want), f"row_argmax {backend} {dtype} {g}"


_ARGMAX_SCRIPT = r"""
import torch
import tests.test_select_kernels as t
t.check_argmax("cpu", (torch.float32, torch.float16))
print("interp-ok")
"""


def test_argmax_triton_kernel_under_interpreter():
    run_interpreted(_ARGMAX_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_argmax_kernel_gpu(backend):
    if not dispatch.has_backend("row_argmax", backend):
        pytest.fail(f"no {backend} kernel for row_argmax (is dflash_ops._C built?)")
    check_argmax("cuda", (torch.float32, torch.bfloat16, torch.float16), GPU_ARGMAX_GRID,
                 backend)
    # torch.argmax on the GPU gives the same answer (finite values, ties included)
    z = argmax_case(dict(m=33, v=151936, k=1, ties=True), torch.bfloat16, 5, "cuda")
    with dispatch.use_backend(backend, ops=("row_argmax",)):
        assert torch.equal(row_argmax(z), z.argmax(-1))
        # a strided z (rows of a wider buffer, the LM head's logits view), 3-D through
        # argmax_last
        wide = torch.randn(5, 3000, device="cuda")
        assert torch.equal(row_argmax(wide[:, 7:2999]), row_argmax_ref(wide[:, 7:2999]))
        z3 = torch.randn(2, 7, 5000, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(argmax_last(z3), row_argmax_ref(z3.reshape(14, 5000)).view(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_argmax_graph_replay_gpu(backend):
    z = argmax_case(dict(m=15, v=151936, k=1), torch.bfloat16, 1, "cuda")
    with dispatch.use_backend(backend, ops=("row_argmax",)):
        row_argmax(z)  # compile before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            idx = row_argmax(z)
    for seed in (2, 3):
        z.copy_(argmax_case(dict(m=15, v=151936, k=1), torch.bfloat16, seed, "cuda"))
        g.replay()
        assert torch.equal(idx, row_argmax_ref(z))
