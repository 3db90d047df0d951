"""models.linear: the per-shape choice between cuBLAS and the Triton GEMM (table parsing, the
rules that keep CPU and fp32 calls on F.linear) and, on the GPU, the Triton path against
F.linear."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_ops import dispatch
from dflash_ops.models import linear as L


def _doc(*entries):
    return {"entries": [dict(n=n, k=k, m=m, cfg=cfg, triton_us=t, cublas_us=c)
                        for n, k, m, cfg, t, c in entries]}


CFG = [16, 64, 128, 8, 4, 3, True, False]


def test_m_bucket():
    assert [L.m_bucket(m) for m in (1, 2, 8, 9, 16, 1000, 1024, 5000)] == \
        [1, 8, 8, 16, 16, 1024, 1024, 4096]


def test_parse_table_keeps_only_triton_wins():
    t = L.parse_table(_doc((4096, 4096, 16, CFG, 20.0, 25.0), (4096, 4096, 32, CFG, 30.0, 25.0),
                           (6144, 4096, 1, None, 0.0, 1.0)))
    assert t == {(4096, 4096): {16: tuple(CFG)}}


def test_parse_table_rejects_a_short_cfg():
    with pytest.raises(ValueError, match="8- to 10-field cfg .* got 5 fields"):
        L.parse_table(_doc((4096, 4096, 16, CFG[:5], 20.0, 25.0)))
    # the ninth and tenth fields (split, serial: sweep_linear writes all ten) are accepted
    assert L.parse_table(_doc((4096, 4096, 16, CFG + [4], 20.0, 25.0))) == \
        {(4096, 4096): {16: tuple(CFG + [4])}}
    assert L.parse_table(_doc((4096, 4096, 16, CFG + [4, False], 20.0, 25.0))) == \
        {(4096, 4096): {16: tuple(CFG + [4, False])}}
    with pytest.raises(ValueError, match="got 11 fields"):
        L.parse_table(_doc((4096, 4096, 16, CFG + [4, False, 1], 20.0, 25.0)))


def test_parse_table_takes_a_cuda_entry_where_the_skinny_kernel_won():
    docs = {"entries": [dict(n=4096, k=4096, m=1, cfg=["cuda"], triton_us=21.0, cublas_us=22.0,
                             skinny_us=19.0),
                        dict(n=4096, k=4096, m=8, cfg=["cuda"], triton_us=None, cublas_us=22.0,
                             skinny_us=23.0),  # not a win: cuBLAS
                        dict(n=6144, k=4096, m=16, cfg=["cuda"], triton_us=None,
                             cublas_us=22.0)]}  # no time: left out
    assert L.parse_table(docs) == {(4096, 4096): {1: L.CUDA_CFG}}


def test_choice_takes_a_cuda_entry_eager_too(monkeypatch):
    monkeypatch.setattr(L, "TABLE", {(64, 32): {1: L.CUDA_CFG, 64: L.CUDA_CFG}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)
    monkeypatch.setattr(L.dispatch, "has_backend", lambda op, backend: True)
    cuda = torch.device("cuda")
    assert L.choice(1, 64, 32, torch.bfloat16, cuda, graph=False) == L.CUDA_CFG  # a C++ launch
    assert L.choice(1, 64, 32, torch.bfloat16, cuda, graph=True) == L.CUDA_CFG
    assert L.choice(40, 64, 32, torch.bfloat16, cuda, graph=True) is None  # past 32 rows
    assert L.choice(1, 64, 32, torch.float32, cuda, graph=True) is None
    monkeypatch.setattr(L.dispatch, "has_backend", lambda op, backend: False)  # no extension
    assert L.choice(1, 64, 32, torch.bfloat16, cuda, graph=True) is None


def test_shipped_table_loads():
    """The committed linear_table.json parses (a field added to ProjCfg once made the sweep
    write 10-field entries the parser refused: every import of models.linear failed)."""
    doc = json.loads(L.TABLE_PATH.read_text())
    assert L.parse_table(doc) == L.TABLE
    assert L.TABLE, "the shipped table has no Triton entry"
    # every exact entry in exact mode's family (at import a stray one is only left out)
    exact = L.parse_exact(doc, strict=True)
    assert sum(map(len, exact.values())) == len(doc.get("exact", []))


def test_choice_is_the_table_on_cuda_half_else_cublas(monkeypatch):
    monkeypatch.setattr(L, "TABLE", {(64, 32): {16: tuple(CFG)}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)  # a table that names no GPU: any
    cuda = torch.device("cuda")
    assert L.choice(16, 64, 32, torch.bfloat16, cuda, graph=True) == tuple(CFG)
    assert L.choice(16, 64, 32, torch.float16, cuda, graph=True) == tuple(CFG)
    assert L.choice(9, 64, 32, torch.bfloat16, cuda, graph=True) == tuple(CFG)  # bucket 16
    assert L.choice(17, 64, 32, torch.bfloat16, cuda, graph=True) is None  # bucket 32: absent
    assert L.choice(16, 32, 64, torch.bfloat16, cuda, graph=True) is None  # (N, K) not in table
    assert L.choice(16, 64, 32, torch.float32, cuda, graph=True) is None
    assert L.choice(16, 64, 32, torch.bfloat16, torch.device("cpu"), graph=True) is None
    assert L.choice(16, 64, 32, torch.bfloat16, cuda, graph=False) is None  # eager: cuBLAS


def test_linear_on_cpu_is_f_linear():
    x, w, b = torch.randn(3, 5, 32), torch.randn(64, 32), torch.randn(64)
    assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(L.linear(x, w), F.linear(x, w))


def _gemm_ops(fn) -> set:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()} & {"aten::mm", "aten::addmm", "aten::bmm",
                                                    "aten::baddbmm"}


@pytest.mark.parametrize("bias", [False, True])
def test_strided_rows_run_one_gemm(bias):
    """Rows that do not flatten without a copy (the drafter's mask rows h.view(R, B, H)[:, 1:]):
    F.linear runs them as a batched GEMM reading w once per leading index (2.4 ms instead of
    0.3 ms for the LM head at batch 8 on the H200, torch 2.11); linear copies them into one 2-D
    GEMM."""
    h = torch.randn(4, 16, 32)
    x, w = h[:, 1:], torch.randn(64, 32)
    b = torch.randn(64) if bias else None
    ops = _gemm_ops(lambda: L.linear(x, w, b))
    assert ops and not ops & {"aten::bmm", "aten::baddbmm"}, ops
    torch.testing.assert_close(L.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 40])
def test_triton_path_matches_f_linear_gpu(monkeypatch, m):
    n, k = 4096, 1024
    cfg = (16 if m <= 16 else 64, 32, 128, 8, 4, 3, True, False)
    monkeypatch.setattr(L, "TABLE", {(n, k): {L.m_bucket(m): cfg}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)  # this table holds on any GPU
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float(), b.float())
    assert L.choice(m, n, k, x.dtype, x.device, graph=True) == cfg
    assert L.choice(m, n, k, x.dtype, x.device) is None  # eager: cuBLAS
    g, got = dispatch.capture_graph(lambda: L.linear(x, w, b))
    g.replay()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(L.linear(x, w, b).float(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 8])
def test_cuda_entry_runs_the_skinny_kernel_gpu(monkeypatch, m):
    """A CUDA_CFG entry: models.linear runs the C++ kv_proj's skinny kernel, eager and under
    graph replay, and matches F.linear."""
    if not dispatch.has_backend("kv_proj", "cuda"):
        pytest.skip("no CUDA extension")
    n, k = 4096, 1024
    monkeypatch.setattr(L, "TABLE", {(n, k): {L.m_bucket(m): L.CUDA_CFG}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float(), b.float())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eager = L.linear(x, w, b)
        torch.cuda.synchronize()
    assert any("skinny_kernel" in e.key for e in prof.key_averages())
    torch.testing.assert_close(eager.float(), want, atol=3e-2, rtol=2e-2)
    g, got = dispatch.capture_graph(lambda: L.linear(x, w, b))
    g.replay()
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


def test_the_table_holds_only_on_the_gpus_it_names(monkeypatch):
    monkeypatch.setattr(L, "TABLE", {(64, 32): {16: tuple(CFG)}})
    monkeypatch.setattr(L, "TABLE_GPUS", ("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(L, "_device_name", lambda i: "NVIDIA A100-SXM4-80GB")
    assert L.choice(16, 64, 32, torch.bfloat16, cuda, graph=True) is None  # cuBLAS elsewhere
    monkeypatch.setattr(L, "_device_name", lambda i: "NVIDIA H100 PCIe")  # not the SXM part
    assert L.choice(16, 64, 32, torch.bfloat16, cuda, graph=True) is None
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(L, "_device_name", lambda i: name)
        assert L.choice(16, 64, 32, torch.bfloat16, cuda, graph=True) == tuple(CFG)
    # the shipped table names the GPU it was measured on first, then the H100 (session 32)
    assert L._load()[2] == ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def test_table_gpus_reads_env_gpu_and_holds_on():
    assert L.table_gpus({"env": {}}) is None  # names no GPU: holds on any
    assert L.table_gpus({"env": {"gpu": "A"}}) == ("A",)
    doc = {"env": {"gpu": "A"}, "holds_on": [{"gpu": "B", "measured": "x"}, {"gpu": "A"}]}
    assert L.table_gpus(doc) == ("A", "B")


@pytest.mark.gpu
@pytest.mark.parametrize("m,split,tma", [(1, 4, True), (8, 3, True), (16, 8, False), (40, 2, True),
                                         (8, 48, True)])  # 48 slices of 40 K steps: 8 empty
def test_split_k_path_matches_f_linear_gpu(monkeypatch, m, split, tma):
    """The split-K kernel through models.linear, bf16, under graph replay: three replays with
    new inputs each (the tiles' counters are back at zero after every call, or a replay would
    leave tiles unwritten), then an eager kernel call on the same counters."""
    from dflash_ops.triton import context as tc
    n, k = 1280, 5120  # DFlash 2's kernel projection
    cfg = (16 if m <= 16 else 64, 32, 128, 8, 4, 3, tma, False, split)
    monkeypatch.setattr(L, "TABLE", {(n, k): {L.m_bucket(m): cfg}})
    monkeypatch.setattr(L, "TABLE_GPUS", None)  # this table holds on any GPU
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    tc._tile_counters(x.device, 1)  # the cached counters exist before capture: replays share them
    g, got = dispatch.capture_graph(lambda: L.linear(x, w, b))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        got.fill_(float("nan"))
        g.replay()
        want = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tc.launch_proj(x, w, b, out, tc.ProjCfg(*cfg))
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()),
                               atol=3e-2, rtol=2e-2)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in tc._COUNTERS.values())


def test_sweep_times_the_skinny_plans_that_fill_the_gpu():
    """benchmarks/sweep_linear.py's plans for the skinny kernel (DFLASH_OPS_SKINNY_PLAN values):
    grids of half an SM each up to eight CTAs an SM, both U, every MT / KG family that fits,
    no more splits than 64-element steps."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep_linear.py"
    spec = importlib.util.spec_from_file_location("sweep_linear", path)
    sw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sw)
    for name, (n, k) in sw.SHAPES.items():
        plans = sw.skinny_plans(n, k, 132)
        assert plans and len(plans) == len(set(plans)), name
        for plan in plans:
            mt, kg, splits, u = map(int, plan.split(","))
            ctas = -(-n // (128 * mt // kg)) * splits
            assert 66 <= ctas <= 8 * 132 and splits <= k // 64 and u in (1, 2), (name, plan)
            assert f"{mt},{kg},{splits},{3 - u}" in plans
    # proj2 (N 1280): 128-row CTAs fill at most 80 CTAs with 8 splits; 32-row ones up to 320
    assert "1,4,8,2" in sw.skinny_plans(1280, 5120, 132)
    assert not any(p.startswith("2,") for p in sw.skinny_plans(1280, 5120, 132))
    assert sw.skinny_plans(151936, 4096, 132) == ["2,1,1,1", "2,1,1,2"]  # the LM head
    assert sw.skinny_plans(256, 128, 132) == []  # 2 steps: too few CTAs at any split
