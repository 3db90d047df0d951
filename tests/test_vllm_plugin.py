"""The vLLM plugin (``dflash_ops/integrations/vllm``), the parts that need no vLLM.

* ``kv_views`` maps each vLLM cache layout onto our [num_blocks, block_size, Hkv, D] views:
  writes through the views land where vLLM's own indexing of that layout puts them, for
  contiguous and permuted storage; unknown layouts give None.
* ``store`` (the plugin's precompute) on the torch backend equals the precompute written out
  in vLLM's terms (hidden norm, one GEMM, per-layer K norm, RoPE, per-layer cache writes) for
  one slot tensor, a per-layer list sharing one buffer, a list of distinct tensors, a list
  with None entries, and None (nothing written); TP shards (each rank's local heads) give each
  rank the unsharded result's heads.
* ``register``: the version gate, ``DFLASH_OPS_VLLM=0`` and idempotence, against a stand-in
  ``vllm`` module. tests/test_vllm_installed.py checks the same against the installed vLLM.
"""
from __future__ import annotations

import contextlib

import sys
import types

import pytest
import torch

from dflash_ops import dispatch
import dflash_ops_vllm as plugin
from dflash_ops.integrations.vllm.cache import kv_views
from dflash_ops.integrations.vllm.context import ContextPlan, fold_hidden_norm, store
from dflash_ops.ops.norm import rms_norm_ref
from dflash_ops.ops.rope import make_cos_sin_cache, rope_values

NB, BS, HKV, D = 6, 16, 2, 64
LAYOUTS = ("blocks-2", "2-blocks", "head-major")


def vllm_cache(layout: str, permuted: bool = False, nb=NB, hkv=HKV, d=D) -> torch.Tensor:
    """A cache of vLLM's shape for ``layout``; ``permuted``: stored in another dim order (as a
    backend's stride order does), seen through a permuted view of vLLM's shape."""
    shape = {"blocks-2": (nb, 2, BS, hkv, d), "2-blocks": (2, nb, BS, hkv, d),
             "head-major": (nb, hkv, BS, 2 * d)}[layout]
    if not permuted:
        return torch.randn(shape)
    order = {"blocks-2": (0, 1, 3, 2, 4), "2-blocks": (0, 1, 3, 2, 4),
             "head-major": (0, 2, 1, 3)}[layout]  # swap block_size and heads in storage
    store_shape = [shape[i] for i in order]
    inv = [order.index(i) for i in range(len(order))]
    return torch.randn(store_shape).permute(*inv)


def vllm_get(cache: torch.Tensor, layout: str, which: int, block: int, row: int) -> torch.Tensor:
    """K (which 0) or V (1) [Hkv, D] at (block, row), indexed as vLLM indexes the layout."""
    if layout == "blocks-2":
        return cache[block, which, row]
    if layout == "2-blocks":
        return cache[which, block, row]
    d = cache.shape[-1] // 2
    return cache[block, :, row, which * d:(which + 1) * d]


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_views_write_where_vllm_reads(layout, permuted):
    cache = vllm_cache(layout, permuted)
    k, v = kv_views(cache, HKV, D)
    assert k.shape == v.shape == (NB, BS, HKV, D)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    g = torch.Generator().manual_seed(0)
    for block, row in ((0, 0), (3, 7), (NB - 1, BS - 1)):
        kv = torch.randn(2, HKV, D, generator=g)
        k[block, row] = kv[0]
        v[block, row] = kv[1]
        assert torch.equal(vllm_get(cache, layout, 0, block, row), kv[0])
        assert torch.equal(vllm_get(cache, layout, 1, block, row), kv[1])


def test_kv_views_list_of_virtual_engines():
    cache = vllm_cache("blocks-2")
    k, _ = kv_views([cache], HKV, D)
    assert k.data_ptr() == cache[:, 0].data_ptr()


@pytest.mark.parametrize("what", ["wrong-heads", "wrong-dim", "rank-3", "not-a-tensor",
                                  "last-dim-strided"])
def test_kv_views_unknown_layout_is_none(what):
    cache = {"wrong-heads": torch.zeros(NB, 2, BS, HKV + 1, D),
             "wrong-dim": torch.zeros(NB, 2, BS, HKV, D + 2),
             "rank-3": torch.zeros(NB, BS, 2 * HKV * D),
             "not-a-tensor": None,
             "last-dim-strided": torch.zeros(NB, 2, BS, HKV, 2 * D)[..., ::2]}[what]
    assert kv_views(cache, HKV, D) is None


# --------------------------------------------------------------------------------------------
# store(): the precompute against vLLM's method written out
# --------------------------------------------------------------------------------------------
def _weights(n_layers, h, hkv, d, seed, bias=True, rot=None, base=1e6):
    g = torch.Generator().manual_seed(seed)
    n = n_layers * 2 * hkv * d
    return dict(
        w_kv=torch.randn(n, h, generator=g) * 0.2,
        bias=torch.randn(n, generator=g) * 0.1 if bias else None,
        k_weight=1 + 0.1 * torch.randn(n_layers, d, generator=g),
        hidden_norm_weight=1 + 0.1 * torch.randn(h, generator=g),
        cos_sin=make_cos_sin_cache(256, rot or d, base))


def vllm_precompute(wt, x, positions, slots, caches, layout, hkv, d, eps, is_neox):
    """vLLM 0.25's precompute_and_store_context_kv in plain torch (rms_norm with the hidden norm
    weight, one GEMM, [T, L, 2, Hkv, D], grouped K RMSNorm, RoPE, per-layer cache writes)."""
    n_layers = len(caches)
    xn = rms_norm_ref(x, wt["hidden_norm_weight"], eps)
    kv = torch.nn.functional.linear(xn, wt["w_kv"], wt["bias"]).view(-1, n_layers, 2, hkv, d)
    for i in range(n_layers):
        k = rms_norm_ref(kv[:, i, 0], wt["k_weight"][i], eps)
        k = rope_values(k, positions, wt["cos_sin"], is_neox)
        s = slots[i] if isinstance(slots, list) else slots
        if s is None:
            continue
        for t, slot in enumerate(s.tolist()):
            if slot < 0:
                continue
            block, row = divmod(slot, BS)
            vllm_get(caches[i], layout, 0, block, row).copy_(k[t])
            vllm_get(caches[i], layout, 1, block, row).copy_(kv[t, i, 1])


def _plan(wt, caches, hkv, d, eps=1e-6, is_neox=True):
    views = [kv_views(c, hkv, d) for c in caches]
    return ContextPlan(w_kv=wt["w_kv"], bias=wt["bias"], k_weight=wt["k_weight"],
                       hidden_norm_weight=wt["hidden_norm_weight"], cos_sin=wt["cos_sin"],
                       k_caches=[k for k, _ in views], v_caches=[v for _, v in views],
                       eps=eps, is_neox=is_neox)


def _slots(kind, t, n_layers, g):
    perm = torch.randperm(NB * BS, generator=g)
    one = perm[:t].clone()
    one[1] = -1  # vLLM's padding slot
    if kind == "tensor":
        return one
    if kind == "list-shared":  # the V2 runner: one slice per layer of one group's buffer
        buf = torch.cat([one, torch.full((4,), -1)])
        return [buf[:t] for _ in range(n_layers)]
    if kind == "list-distinct":
        return [perm[i * t:(i + 1) * t].clone() for i in range(n_layers)]
    if kind == "list-with-none":
        return [None if i == 1 else perm[i * t:(i + 1) * t].clone() for i in range(n_layers)]
    return None


@pytest.mark.parametrize("is_neox,rot", [(True, None), (False, None), (True, 32)],
                         ids=["neox", "gptj", "neox-partial"])
@pytest.mark.parametrize("slots_kind", ["tensor", "list-shared", "list-distinct",
                                        "list-with-none", "none"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("folded", [False, True], ids=["hidden_norm", "folded"])
def test_store_equals_vllm_precompute(layout, slots_kind, is_neox, rot, folded):
    """folded: the plan as build_plan makes it (the hidden norm's weight folded into w_kv,
    hidden_rms), against vLLM's own order (norm, then the GEMM)."""
    n_layers, h, t, eps = 3, 48, 11, 1e-6
    g = torch.Generator().manual_seed(1)
    wt = _weights(n_layers, h, HKV, D, seed=2, rot=rot)
    x = torch.randn(t, h, generator=g)
    positions = torch.randint(0, 256, (t,), generator=g)
    slots = _slots(slots_kind, t, n_layers, g)
    ours = [vllm_cache(layout, permuted=(i == 1)) for i in range(n_layers)]
    want = [c.clone() for c in ours]
    before = [c.clone() for c in ours]
    vllm_precompute(wt, x, positions, slots, want, layout, HKV, D, eps, is_neox)
    from dflash_ops.integrations.vllm import context as ctx
    n_calls = []
    real = ctx.context_kv_
    ctx.context_kv_ = lambda *a, **k: (n_calls.append(len(a[7])), real(*a, **k))
    try:
        with dispatch.use_backend("torch", ops=("context_kv_",)):
            plan = _plan(wt, ours, HKV, D, eps, is_neox)
            store(fold_hidden_norm(plan) if folded else plan, x, positions, slots)
    finally:
        ctx.context_kv_ = real
    # one fused call of every layer for one tensor or a list sharing one buffer, a call per
    # layer with a slot tensor otherwise, none for None
    want_calls = {"tensor": [n_layers], "list-shared": [n_layers], "list-distinct": [1] * 3,
                  "list-with-none": [1, 1], "none": []}[slots_kind]
    assert n_calls == want_calls, n_calls
    for i, (got, w) in enumerate(zip(ours, want)):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"layer {i} {layout} {slots_kind}: {m}")
    if slots_kind == "none":
        assert all(torch.equal(a, b) for a, b in zip(ours, before))


def test_store_rejects_a_list_of_the_wrong_length():
    wt = _weights(2, 32, HKV, D, seed=0)
    plan = _plan(wt, [vllm_cache("blocks-2") for _ in range(2)], HKV, D)
    with pytest.raises(ValueError, match=r"context_slot_mapping must hold one entry per draft "
                                         r"layer \(2\), got 3"):
        store(plan, torch.randn(4, 32), torch.arange(4), [torch.arange(4)] * 3)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tensor_parallel_shards_give_each_rank_its_heads(device):
    """A TP=2 drafter as vLLM shards it: each rank's fused K/V rows are its local KV heads of
    every layer (QKVParallelLinear), its caches hold Hkv / 2 heads. Each rank's caches equal the
    unsharded result's heads of that rank. cpu: the torch reference, fp32, exactly; cuda: the
    default kernels (cuBLAS GEMM + dflash.context_kv_), bf16, within 2 bf16 ulps of the largest
    value (the two GEMMs have different N, so cuBLAS may pick other kernels)."""
    n_layers, h, t, hkv, tp = 2, 32, 9, 4, 2
    g = torch.Generator().manual_seed(3)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    wt = {k: None if v is None else v.to(device=device, dtype=dt if k != "cos_sin" else v.dtype)
          for k, v in _weights(n_layers, h, hkv, D, seed=4).items()}
    x = torch.randn(t, h, generator=g).to(device, dt)
    positions = torch.randint(0, 256, (t,), generator=g).to(device)
    slots = torch.randperm(NB * BS, generator=g)[:t].to(device)
    def backend():  # a fresh context each time
        return dispatch.use_backend("torch", ops=("context_kv_",)) if device == "cpu" else \
            contextlib.nullcontext()

    def cache(heads):
        return vllm_cache("blocks-2", hkv=heads).to(device, dt)

    full = [cache(hkv) for _ in range(n_layers)]
    with backend():
        store(_plan(wt, full, hkv, D), x, positions, slots)
    loc = hkv // tp
    w = wt["w_kv"].view(n_layers, 2, hkv, D, h)
    b = wt["bias"].view(n_layers, 2, hkv, D)
    tol = 0 if device == "cpu" else \
        2 * 2.0 ** -8 * max(c.float().abs().max().item() for c in full)
    for rank in range(tp):
        heads = slice(rank * loc, (rank + 1) * loc)
        shard = dict(wt, w_kv=w[:, :, heads].reshape(-1, h).contiguous(),
                     bias=b[:, :, heads].reshape(-1).contiguous())
        caches = [cache(loc) for _ in range(n_layers)]
        with backend():
            store(_plan(shard, caches, loc, D), x, positions, slots)
        for i in range(n_layers):
            for s in slots.tolist():
                blk, row = divmod(s, BS)
                for which in (0, 1):
                    torch.testing.assert_close(caches[i][blk, which, row].float(),
                                               full[i][blk, which, row, heads].float(),
                                               atol=tol, rtol=0)


# --------------------------------------------------------------------------------------------
# register(): version gate, DFLASH_OPS_VLLM=0, idempotence (a stand-in vllm module)
# --------------------------------------------------------------------------------------------
class _Calls(list):
    custom = None


class _Custom:
    """A stand-in for vLLM's AttentionBackendEnum.CUSTOM (``path``: who holds the slot)."""
    path = None

    def is_overridden(self):
        return self.path is not None

    def get_path(self):
        return self.path


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` (its model registry and attention-backend registry) recording the
    registrations as ("model", arch, class) and ("backend", path)."""
    calls = _Calls()
    mod = types.ModuleType("vllm")
    mod.ModelRegistry = types.SimpleNamespace(
        register_model=lambda a, c: calls.append(("model", a, c)))
    custom = _Custom()

    def register_backend(member, path):
        assert member is custom
        custom.path = path
        calls.append(("backend", path))

    reg = types.ModuleType("vllm.v1.attention.backends.registry")
    reg.AttentionBackendEnum = types.SimpleNamespace(CUSTOM=custom)
    reg.register_backend = register_backend
    monkeypatch.setitem(sys.modules, "vllm", mod)
    for name in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", reg)
    monkeypatch.setitem(plugin._state, "registered", False)
    monkeypatch.delenv("DFLASH_OPS_VLLM", raising=False)
    calls.custom = custom
    return calls



@pytest.mark.parametrize("ver,ok", [("0.25.1", True), ("0.25.0", True), ("0.33.0", True),
                                    ("0.25.1+cu130", True), ("0.33.1", False), ("0.24.0", False),
                                    ("0.2.5", False), ("", False)])
def test_register_version_gate(fake_vllm, monkeypatch, caplog, ver, ok):
    monkeypatch.setattr(plugin, "vllm_version", lambda: ver)
    with caplog.at_level("INFO", logger="vllm.dflash_ops"):
        assert plugin.register() is ok
    want = [("model", plugin.ARCH, plugin.MODEL_CLS), ("backend", plugin.BACKEND_CLS)]
    assert list(fake_vllm) == (want if ok else [])
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == (2 if ok else 1), msgs
    if not ok:
        assert "not a tested version" in msgs[0] and "untouched" in msgs[0]


def test_register_leaves_a_taken_custom_backend_slot(fake_vllm, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.25.1")
    fake_vllm.custom.path = "someone.else.Backend"
    with caplog.at_level("INFO", logger="vllm.dflash_ops"):
        assert plugin.register()
    assert list(fake_vllm) == [("model", plugin.ARCH, plugin.MODEL_CLS)]
    assert fake_vllm.custom.path == "someone.else.Backend"
    assert any("CUSTOM attention backend is taken (someone.else.Backend)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_register_disabled_by_env(fake_vllm, monkeypatch, caplog, value):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.25.1")
    monkeypatch.setenv("DFLASH_OPS_VLLM", value)
    with caplog.at_level("INFO", logger="vllm.dflash_ops"):
        assert plugin.register() is False
    assert fake_vllm == []
    assert any("DFLASH_OPS_VLLM=0" in r.getMessage() for r in caplog.records)


def test_register_is_idempotent(fake_vllm, monkeypatch):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.25.1")
    assert plugin.register() and plugin.register() and plugin.register()
    assert len(fake_vllm) == 2  # the model and the backend, once


def test_register_imports_no_cuda_and_no_model_code(fake_vllm, monkeypatch):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.25.1")
    for m in ("model", "attention"):
        monkeypatch.delitem(sys.modules, f"dflash_ops.integrations.vllm.{m}", raising=False)
    plugin.register()
    assert "dflash_ops.integrations.vllm.model" not in sys.modules
    assert "dflash_ops.integrations.vllm.attention" not in sys.modules
    assert plugin.MODEL_CLS.count(":") == 1  # vLLM's lazy "module:class" form
