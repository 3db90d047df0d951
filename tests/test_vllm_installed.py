"""The vLLM plugin against the installed vLLM (0.33.0 on CPU in CI: tests/requirements-vllm.txt;
the GPU run with vLLM 0.25.1 is benchmarks/vllm_check.py via gpu_check.sh vllm).

The entry point is installed and loads ``register``; ``register`` puts our class into vLLM's
registry as a lazy ``module:class`` entry and our draft attention backend into the CUSTOM slot; the class is a subclass of vLLM's DFlash model with the
same ``precompute_and_store_context_kv`` signature as vLLM's (at both levels); every fused buffer
the plugin reads is one vLLM's ``_build_fused_kv_buffers`` sets; and for every KV-cache layout
vLLM declares, our K/V views are exactly the views vLLM's TRITON_ATTN cache update writes through.
The attention backend: vLLM's configuration checks refuse what our kernels lack, the impl's
constructor refuses the rest by name, every method they override keeps vLLM's signature, and
its forward / cache update (torch backend, CPU) equal our reference on vLLM's cache and
metadata, padded rows untouched.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM not installed (pip install --no-deps -r "
                                          "tests/requirements-vllm.txt)")

import dflash_ops_vllm as plugin  # noqa: E402
from dflash_ops.integrations.vllm.cache import kv_views  # noqa: E402


def test_installed_version_is_a_tested_one():
    assert plugin.supported(plugin.vllm_version()), plugin.vllm_version()


def test_entry_point_loads_register():
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dflash_ops"]
    assert len(eps) == 1, eps
    assert eps[0].load() is plugin.register


def test_loading_the_plugin_imports_neither_dflash_ops_nor_cuda():
    """vLLM loads general plugins in every process (API server, engine core, workers): loading
    and calling ours must not import dflash_ops (its kernels, its extension or a JIT build of
    csrc/) nor initialise CUDA. A fresh interpreter, as vLLM's processes are."""
    import subprocess
    import sys
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "ep, = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'dflash_ops']\n"
        "assert ep.load()() is True\n"
        "import torch\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dflash_ops'),"
        " torch.cuda.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] False", out.stdout


@pytest.fixture
def registry(monkeypatch):
    from vllm.model_executor.models.registry import ModelRegistry
    saved = dict(ModelRegistry.models)
    monkeypatch.setitem(plugin._state, "registered", False)
    monkeypatch.delenv("DFLASH_OPS_VLLM", raising=False)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    custom = AttentionBackendEnum.CUSTOM
    held = custom.get_path() if custom.is_overridden() else None
    yield ModelRegistry
    ModelRegistry.models.clear()
    ModelRegistry.models.update(saved)
    if held is None:
        custom.clear_override()


def test_register_puts_our_class_in_vllms_registry(registry):
    aliases = [a for a, e in registry.models.items()
               if getattr(e, "class_name", None) == "DFlashQwen3ForCausalLM"]
    assert plugin.ARCH in aliases
    assert plugin.register()
    entry = registry.models[plugin.ARCH]
    module, cls = plugin.MODEL_CLS.split(":")
    assert (entry.module_name, entry.class_name) == (module, cls)
    for arch in aliases:  # 0.33's aliases of the same model class too
        e = registry.models[arch]
        assert (e.module_name, e.class_name) == (module, cls), arch
    assert plugin.register()  # idempotent
    assert registry.models[plugin.ARCH] is entry


def test_disabled_register_leaves_vllms_registry_alone(registry, monkeypatch):
    before = registry.models[plugin.ARCH]
    monkeypatch.setenv("DFLASH_OPS_VLLM", "0")
    assert not plugin.register()
    assert registry.models[plugin.ARCH] is before


def _ours():
    from dflash_ops.integrations.vllm.model import DFlashOpsQwen3ForCausalLM
    return DFlashOpsQwen3ForCausalLM


def test_subclass_of_vllms_dflash_model():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    assert issubclass(_ours(), DFlashQwen3ForCausalLM)


@pytest.mark.parametrize("level", ["ForCausalLM", "Model"])
def test_precompute_signature_matches_vllms(level):
    from vllm.model_executor.models import qwen3_dflash as q
    theirs = getattr(q, f"DFlashQwen3{level}").precompute_and_store_context_kv
    ours = _ours().precompute_and_store_context_kv

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert params(ours) == params(theirs)


READ = ("_fused_kv_weight", "_fused_kv_bias", "_k_norm_weights", "_hidden_norm_weight",
        "_rope_cos_sin_cache", "_rope_is_neox", "_rms_norm_eps", "_num_kv_heads", "_head_dim",
        "_attn_layers", "_num_attn_layers")


def test_every_buffer_the_plugin_reads_is_set_by_vllm():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    src = "".join(inspect.getsource(getattr(DFlashQwen3Model, n)) for n in
                  ("_build_fused_kv_buffers", "_build_context_kv_buffers")
                  if hasattr(DFlashQwen3Model, n))
    ours = inspect.getsource(__import__("dflash_ops.integrations.vllm.model",
                                        fromlist=["build_plan"]))
    for name in READ:
        assert re.search(rf"self\.{name}\b[^=\n]*=", src), f"vLLM no longer sets {name}"
        assert f"m.{name}" in ours or f'"{name}"' in ours, f"test lists {name}, plugin reads none"


def _layer_views():
    """One layer's [B, H, N, 2*D] cache as vLLM 0.33 lays it out for each KVCacheLayout (the
    physical order is the layout's layer view order); none before 0.33 (no such module)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return
    b, h, n, d = 5, 2, 16, 64
    logical = (b, h, n, 2 * d)
    for layout in KVCacheLayout:
        order = layout.layer_view_order
        phys = torch.randn([logical[i] for i in order])
        inv = [order.index(i) for i in range(4)]
        yield layout.name, phys.permute(*inv), h, d


@pytest.mark.parametrize("name,cache,h,d", list(_layer_views()),
                         ids=[v[0] for v in _layer_views()])
def test_views_are_vllms_triton_split(name, cache, h, d):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    src = inspect.getsource(TritonAttentionImpl.do_kv_cache_update)
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in src, \
        "vLLM's TRITON_ATTN cache split changed: re-check integrations/vllm/cache.py"
    want_k, want_v = cache.transpose(1, 2).split(d, dim=-1)
    k, v = kv_views(cache, h, d)
    for got, want in ((k, want_k), (v, want_v)):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.data_ptr() == want.data_ptr()


# --------------------------------------------------------------------------------------------
# build_plan on a stand-in of vLLM's DFlashQwen3Model (CPU): the fallbacks, and a plan whose
# store() writes what vLLM's method does (tests/test_vllm_plugin.py's written-out precompute)
# --------------------------------------------------------------------------------------------
def _fake_model(layout="blocks-2", n_layers=2, h=32, hkv=2, d=64, kv_dtype="auto", **over):
    import types
    from tests.test_vllm_plugin import _weights, vllm_cache
    wt = _weights(n_layers, h, hkv, d, seed=7)
    attn = [types.SimpleNamespace(kv_cache=vllm_cache(layout, hkv=hkv, d=d),
                                  kv_cache_dtype=kv_dtype) for _ in range(n_layers)]
    norm = types.SimpleNamespace(weight=torch.nn.Parameter(wt["hidden_norm_weight"]))
    m = types.SimpleNamespace(  # _hidden_norm_weight is the parameter's .data, as in vLLM
        quant_config=None, _fused_kv_weight=wt["w_kv"], _fused_kv_bias=wt["bias"],
        _k_norm_weights=wt["k_weight"], hidden_norm=norm, _hidden_norm_weight=norm.weight.data,
        _rope_cos_sin_cache=wt["cos_sin"], _rope_is_neox=True, _rms_norm_eps=1e-6,
        _num_kv_heads=hkv, _head_dim=d, _attn_layers=attn, _num_attn_layers=n_layers,
        layers=[types.SimpleNamespace(self_attn=types.SimpleNamespace())])
    for k, v in over.items():
        setattr(m, k, v)
    return m, wt


@pytest.mark.parametrize("what,match", [
    ("quant", "quantized drafter weights"), ("no-fused", "no fused K/V weight"),
    ("v-scale", "attention_value_scale"), ("fp8-cache", "KV cache dtype fp8"),
    ("layout", "KV cache layout"), ("dtype", "drafter weights"), ("head", "head size 48"),
    ("rope", "RoPE table")])
def test_build_plan_falls_back_with_one_log_line(what, match, caplog):
    from dflash_ops.integrations.vllm import model as pm
    m, _ = _fake_model()
    x = torch.randn(3, 32)
    if what == "quant":
        m.quant_config = object()
    elif what == "no-fused":
        m._fused_kv_weight = None
    elif what == "v-scale":
        m.layers[0].self_attn.v_scale = 0.5
    elif what == "fp8-cache":
        for a in m._attn_layers:
            a.kv_cache_dtype = "fp8_e4m3"
    elif what == "layout":
        m._attn_layers[1].kv_cache = torch.zeros(4, 3, 16, 2, 64)
    elif what == "dtype":
        x = x.half()
    elif what == "head":
        m._head_dim = 48
    elif what == "rope":
        m._rope_cos_sin_cache = torch.zeros(10, 66)
    pm._logged.clear()
    with caplog.at_level("WARNING", logger="vllm.dflash_ops"):
        assert pm.build_plan(m, x) is None
        assert pm.build_plan(m, x) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and match in msgs[0] and "vLLM's own" in msgs[0], msgs


@pytest.mark.parametrize("layout", ["blocks-2", "head-major"])
def test_build_plan_writes_what_vllm_writes(layout):
    from dflash_ops import dispatch
    from dflash_ops.integrations.vllm import model as pm
    from dflash_ops.integrations.vllm.context import store
    from tests.test_vllm_plugin import NB, BS, vllm_precompute
    m, wt = _fake_model(layout)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 32, generator=g)
    pos = torch.randint(0, 256, (7,), generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:7]
    want = [a.kv_cache.clone() for a in m._attn_layers]
    vllm_precompute(wt, x, pos, slots, want, layout, 2, 64, 1e-6, True)
    plan = pm.build_plan(m, x)
    with dispatch.use_backend("torch", ops=("context_kv_",)):
        store(plan, x, pos, slots)
    for a, w in zip(m._attn_layers, want):
        torch.testing.assert_close(a.kv_cache, w, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# The draft attention backend (CUSTOM)
# --------------------------------------------------------------------------------------------
def test_register_puts_our_backend_in_the_custom_slot(registry):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from dflash_ops.integrations.vllm.attention import DFlashOpsAttentionBackend
    assert plugin.register()
    custom = AttentionBackendEnum.CUSTOM
    assert custom.get_path() == plugin.BACKEND_CLS
    assert custom.get_class() is DFlashOpsAttentionBackend
    assert issubclass(DFlashOpsAttentionBackend, TritonAttentionBackend)
    assert DFlashOpsAttentionBackend.get_name() == "CUSTOM"


@pytest.mark.parametrize("cls", ["DFlashOpsAttentionImpl", "DFlashOpsAttentionBackend"])
def test_backend_overrides_keep_vllms_signatures(cls):
    """Every method our impl / backend overrides takes vLLM's parameters (names, kinds,
    defaults): a vLLM release that changes one (API drift) fails here, not at serving time.
    Overrides that forward ``*args, **kwargs`` unchanged are exempt."""
    from dflash_ops.integrations.vllm import attention as ours
    mine = getattr(ours, cls)
    parent = mine.__mro__[1]

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    checked = []
    for name, attr in vars(mine).items():
        f = getattr(attr, "__func__", attr)
        if not callable(f) or not hasattr(parent, name) or name.startswith("__") and \
                name != "__init__":
            continue
        kinds = {p.kind for p in inspect.signature(f).parameters.values()}
        if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
            continue
        assert params(getattr(mine, name)) == params(getattr(parent, name)), name
        checked.append(name)
    assert checked, f"{cls}: no overridden method was compared"


def _validate(**over):
    """vLLM's validate_configuration of our backend, called with the parameters this vLLM's
    signature has (it differs between releases)."""
    from vllm.platforms.interface import DeviceCapability
    from dflash_ops.integrations.vllm.attention import DFlashOpsAttentionBackend as B
    values = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                  use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                  attn_type="decoder", use_non_causal=True, use_batch_invariant=False)
    values.update(over)
    params = inspect.signature(B.validate_configuration).parameters
    kw = {n: values[n] for n in params if n in values}
    missing = [n for n, p in params.items() if n not in kw and p.default is inspect._empty]
    assert not missing, f"validate_configuration has new required parameters {missing}"
    return B.validate_configuration(**kw)


def test_backend_accepts_the_drafters_configuration():
    assert _validate() == []


@pytest.mark.parametrize("over,reason", [
    (dict(head_size=48), "head_size"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(attn_type="encoder_only"), "attention type"),
    (dict(use_batch_invariant=True), "batch invariance"),
    (dict(use_mm_prefix=True), "multimodal")])
def test_backend_refuses_at_configuration_time(over, reason):
    reasons = _validate(**over)
    assert any(reason in r for r in reasons), reasons


def _impl(**over):
    from dflash_ops.integrations.vllm.attention import DFlashOpsAttentionImpl
    kw = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
              sliding_window=None, kv_cache_dtype="auto")
    kw.update(over)
    return DFlashOpsAttentionImpl(**kw)


@pytest.mark.parametrize("over,what", [
    (dict(alibi_slopes=[0.5] * 8), "ALiBi"), (dict(logits_soft_cap=30.0), "soft cap"),
    (dict(head_size=48), "head size 48"), (dict(kv_cache_dtype="fp8"), "KV cache dtype fp8")])
def test_impl_refuses_what_our_kernels_lack(over, what):
    with pytest.raises(ValueError, match=rf"dflash_ops attention backend \(CUSTOM\): .*{what}"):
        _impl(**over)


@pytest.mark.parametrize("layout", ["blocks-2", "head-major"])
@pytest.mark.parametrize("causal,window,sinks", [(False, None, False), (True, None, True),
                                                 (False, 5, True), (True, 3, False)])
def test_forward_equals_our_reference_on_vllms_cache(causal, window, sinks, layout):
    """The argument mapping (views, window W from vLLM's (W - 1, 0), sinks, causal, padded rows,
    a block table with more rows than requests) on the torch backend; the kernels themselves
    against vLLM's TRITON_ATTN impl: benchmarks/vllm_check.py attention (GPU)."""
    import types
    from dflash_ops import dispatch
    from dflash_ops.ops.attention import block_attention_ref
    from tests.test_vllm_plugin import vllm_cache
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, nb, bs = 8, 2, 64, 6, 16
    sink_w = torch.randn(hq, generator=g) if sinks else None
    impl = _impl(sliding_window=window, sinks=sink_w)
    cache = vllm_cache(layout)
    seq_lens = torch.tensor([20, 7, 33], dtype=torch.int32)
    q_lens = [4, 3, 5]
    qsl = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
    # a persistent table with a spare row (vLLM slices it to the requests; we must too)
    table = torch.tensor([[0, 3, 0], [5, 0, 0], [1, 2, 4], [9, 9, 9]], dtype=torch.int32)
    n, pad = sum(q_lens), 4
    query = torch.randn(n + pad, hq * d, generator=g)
    output = torch.zeros(n + pad, hq * d)
    meta = types.SimpleNamespace(num_actual_tokens=n, query_start_loc=qsl, seq_lens=seq_lens,
                                 block_table=table, causal=causal, use_cascade=False)
    with dispatch.use_backend("torch", ops=("block_attention_out_",)):
        got = impl.forward(None, query, None, None, cache, meta, output)
    assert got is output
    kv = kv_views(cache, hkv, d)
    want = block_attention_ref(query[:n].view(n, hq, d), kv[0], kv[1], table[:3], seq_lens, qsl,
                               0.125, causal, window or -1, sink_w)
    torch.testing.assert_close(output[:n].view(n, hq, d), want)
    assert bool((output[n:] == 0).all()), "padded rows written"


def test_forward_refuses_per_request_causal_flags():
    import types
    impl = _impl()
    meta = types.SimpleNamespace(num_actual_tokens=1, causal=torch.tensor([True]),
                                 use_cascade=False)
    with pytest.raises(ValueError, match="per-request causal flags"):
        impl.forward(None, torch.zeros(1, 512), None, None, torch.zeros(2, 2, 16, 2, 64), meta,
                     torch.zeros(1, 512))


@pytest.mark.parametrize("layout", ["blocks-2", "head-major"])
def test_do_kv_cache_update_writes_where_vllm_does(layout):
    """K/V as vLLM passes them (column slices of the qkv GEMM output, 2 padded rows past the
    slots) into both cache layouts, against vLLM's own indexing of each layout."""
    from dflash_ops import dispatch
    from tests.test_vllm_plugin import vllm_cache, vllm_get
    g = torch.Generator().manual_seed(10)
    impl = _impl()
    cache = vllm_cache(layout)
    before = cache.clone()
    qkv = torch.randn(7, (8 + 2 * 2) * 64, generator=g)
    key = qkv[:, 8 * 64:10 * 64].view(7, 2, 64)
    value = qkv[:, 10 * 64:].view(7, 2, 64)
    slots = torch.tensor([3, -1, 40, 95, 17])
    with dispatch.use_backend("torch", ops=("store_kv_",)):
        impl.do_kv_cache_update(None, key, value, cache, slots)
    want = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            vllm_get(want, layout, 0, s // 16, s % 16).copy_(key[t])
            vllm_get(want, layout, 1, s // 16, s % 16).copy_(value[t])
    assert torch.equal(cache, want)


# --------------------------------------------------------------------------------------------
# The model class's wiring (the device check patched: CPU tensors, torch backend)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def wired(monkeypatch):
    """Our model class on a stand-in drafter model, with the CUDA-only gates opened and vLLM's
    own method recorded instead of run."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from dflash_ops.integrations.vllm import model as pm
    calls = {"stock": 0, "build": 0}
    monkeypatch.setattr(pm, "_device_ok", lambda x: True)
    monkeypatch.setattr(pm, "probe", lambda plan, x, pos: None)
    real_build = pm.build_plan

    def counting_build(m, x):
        calls["build"] += 1
        return real_build(m, x)

    monkeypatch.setattr(pm, "build_plan", counting_build)

    def stock(self, *a, **k):
        calls["stock"] += 1

    monkeypatch.setattr(DFlashQwen3ForCausalLM, "precompute_and_store_context_kv", stock)
    obj = pm.DFlashOpsQwen3ForCausalLM.__new__(pm.DFlashOpsQwen3ForCausalLM)
    torch.nn.Module.__init__(obj)
    m, wt = _fake_model()
    object.__setattr__(obj, "model", m)
    return obj, m, wt, calls


def test_model_none_slots_run_vllms_method(wired):
    obj, m, wt, calls = wired
    obj.precompute_and_store_context_kv(torch.randn(3, 32), torch.arange(3), None)
    assert calls == {"stock": 1, "build": 0}


def test_model_writes_caches_and_caches_its_plan(wired):
    from tests.test_vllm_plugin import NB, BS, vllm_precompute
    obj, m, wt, calls = wired
    g = torch.Generator().manual_seed(11)
    for step in range(3):
        x = torch.randn(5, 32, generator=g)
        pos = torch.randint(0, 256, (5,), generator=g)
        slots = torch.randperm(NB * BS, generator=g)[:5]
        want = [a.kv_cache.clone() for a in m._attn_layers]
        vllm_precompute(wt, x, pos, slots, want, "blocks-2", 2, 64, 1e-6, True)
        obj.precompute_and_store_context_kv(x, pos, slots)
        for a, w in zip(m._attn_layers, want):
            torch.testing.assert_close(a.kv_cache, w, atol=1e-5, rtol=1e-5)
    assert calls == {"stock": 0, "build": 1}


@pytest.mark.parametrize("what", ["cache-moved", "weights-reloaded", "weights-reloaded-in-place",
                                  "norm-updated-in-place"])
def test_model_rebuilds_its_plan_when_vllm_moves_things(wired, what):
    from tests.test_vllm_plugin import vllm_cache
    obj, m, wt, calls = wired
    x, pos, slots = torch.randn(2, 32), torch.arange(2), torch.tensor([0, 1])
    obj.precompute_and_store_context_kv(x, pos, slots)
    if what == "cache-moved":  # vLLM binds the real caches after profiling
        m._attn_layers[1].kv_cache = vllm_cache("blocks-2")
    elif what == "weights-reloaded":  # load_weights restacks the buffers
        m._fused_kv_weight = m._fused_kv_weight.clone() * 2
    elif what == "weights-reloaded-in-place":  # new values in the same buffer: the plan's
        m._fused_kv_weight.mul_(2)                # folded copy must follow
    else:  # the norm parameter itself (vLLM reads it through its .data alias, whose version
        with torch.no_grad():  # counter does not move)
            m.hidden_norm.weight.mul_(2)
    obj.precompute_and_store_context_kv(x, pos, slots)
    assert calls["build"] == 2
    plan = obj._dflash_ops_cached[1]
    if what == "cache-moved":
        assert plan.k_caches[1].data_ptr() == m._attn_layers[1].kv_cache[:, 0].data_ptr()
    else:  # the hidden norm folded into the (new) stacked weight
        assert plan.hidden_rms and plan.hidden_norm_weight is None
        assert torch.equal(plan.w_kv, m._fused_kv_weight * m._hidden_norm_weight[None, :])
