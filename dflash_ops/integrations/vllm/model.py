"""``DFlashOpsQwen3ForCausalLM``: vLLM's ``DFlashQwen3ForCausalLM`` (a subclass: vLLM's
proposer checks isinstance) whose ``precompute_and_store_context_kv`` runs
``torch.ops.dflash.context_kv_`` into each layer's vLLM cache. Imported by vLLM through the
registry's lazy ``module:class`` entry, i.e. only when it builds the drafter.

The plan (weights vLLM stacked in ``_build_fused_kv_buffers``, cache views) is built at the first
call that writes, checked by one probe call (nothing written), and rebuilt when a layer's cache
or a stacked buffer moves (vLLM binds the real caches after its memory profiling and restacks
the buffers when it loads weights). vLLM's own method runs instead, with one log line, for quantized weights,
an fp8 KV cache, an unknown cache layout, a head size or device our kernels lack. Under tensor
parallelism every buffer vLLM stacked is already the rank's shard (its local KV heads).
Also left to vLLM: a value scale (0.33's ``attention_value_scale``), which our op lacks.
"""
from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

import dflash_ops  # noqa: F401  (registers torch.ops.dflash)
from dflash_ops.ops.rope import HEAD_DIMS

from dflash_ops_vllm import log
from .cache import kv_views
from .context import ContextPlan, fold_hidden_norm, store

FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_logged = set()


def _once(msg: str, *args) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.warning("dflash_ops: " + msg, *args)


def _ptr(t) -> Optional[int]:
    t = t[0] if isinstance(t, (list, tuple)) and t else t
    return t.data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None


def _plan_key(m, x: torch.Tensor) -> tuple:
    """What a plan depends on: the context dtype / device, every layer's cache and the stacked
    buffers vLLM rebuilds whenever it loads weights (a reload must not leave us on old ones)."""
    bufs = ("_fused_kv_weight", "_fused_kv_bias", "_k_norm_weights", "_hidden_norm_weight",
            "_rope_cos_sin_cache")
    # the plan holds a copy of the stacked weight with the hidden norm folded in: an in-place
    # reload of either (same pointers) must rebuild it too. vLLM's _hidden_norm_weight is the
    # parameter's .data, whose version counter is its own: an in-place update of the parameter
    # moves only the parameter's, so both are read. A write through a fresh .data
    # (param.data.copy_ outside load_weights) moves no counter and is not seen; vLLM's reloads
    # go through load_weights, which restacks the buffers (new pointers)
    norm = getattr(getattr(m, "hidden_norm", None), "weight", None)
    versions = tuple(getattr(t, "_version", None)
                     for t in (getattr(m, "_fused_kv_weight", None),
                               getattr(m, "_hidden_norm_weight", None), norm))
    return (x.dtype, x.device, tuple(_ptr(a.kv_cache) for a in m._attn_layers),
            tuple(_ptr(getattr(m, b, None)) for b in bufs), versions)


def _device_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def build_plan(m, x: torch.Tensor) -> Optional[ContextPlan]:
    """The plan for drafter model ``m`` (vLLM's DFlashQwen3Model, fused buffers built) and context
    states like ``x``, or None (logged once) where vLLM's own method must run."""
    if getattr(m, "quant_config", None) is not None:
        return _once("quantized drafter weights (%s): vLLM's own context precompute runs",
                     type(m.quant_config).__name__)
    w = getattr(m, "_fused_kv_weight", None)
    if w is None:  # vLLM 0.33 leaves it None when a projection is quantized
        return _once("no fused K/V weight (quantized projections): vLLM's own context "
                     "precompute runs")
    if getattr(m.layers[0].self_attn, "v_scale", None) is not None:  # 0.33's value scale
        return _once("attention_value_scale set: vLLM's own context precompute runs")
    if w.dtype not in FLOAT or w.dtype != x.dtype:
        return _once("drafter weights %s with context states %s: vLLM's own context "
                     "precompute runs", w.dtype, x.dtype)
    hkv, d = m._num_kv_heads, m._head_dim
    if d not in HEAD_DIMS:
        return _once("head size %d (ours: %s): vLLM's own context precompute runs", d,
                     HEAD_DIMS)
    ks, vs = [], []
    for i, a in enumerate(m._attn_layers):
        dt = str(getattr(a, "kv_cache_dtype", "auto"))
        if dt not in ("auto", "bfloat16", "float16", "float32", "half"):
            return _once("KV cache dtype %s: vLLM's own context precompute runs", dt)
        views = kv_views(a.kv_cache, hkv, d)
        if views is None:
            shape = getattr(a.kv_cache, "shape", None)
            return _once("KV cache layout %s (Hkv %d, D %d) not known: vLLM's own context "
                         "precompute runs", list(shape) if shape is not None else shape, hkv, d)
        if views[0].dtype != x.dtype:
            return _once("KV cache %s with context states %s: vLLM's own context precompute "
                         "runs", views[0].dtype, x.dtype)
        ks.append(views[0])
        vs.append(views[1])
    cos_sin = m._rope_cos_sin_cache.float()
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or cos_sin.shape[1] > d:
        return _once("RoPE table %s for head size %d: vLLM's own context precompute runs",
                     list(cos_sin.shape), d)
    return fold_hidden_norm(ContextPlan(
        w_kv=w, bias=m._fused_kv_bias, k_weight=m._k_norm_weights,
        hidden_norm_weight=m._hidden_norm_weight, cos_sin=cos_sin.contiguous(), k_caches=ks,
        v_caches=vs, eps=float(m._rms_norm_eps), is_neox=bool(m._rope_is_neox)))


def probe(plan: ContextPlan, x: torch.Tensor, positions: torch.Tensor) -> Optional[str]:
    """Why our kernels cannot serve this plan on x's device (None: they can): no compiled
    kernel (the torch reference would synchronise the host), or a first call (one row, slot -1:
    nothing written) that fails, e.g. a GPU the extension was not built for."""
    from dflash_ops import dispatch
    backend = dispatch.resolve("context_kv_", x.device)
    if backend == "torch":
        return "no compiled dflash_ops kernel for context_kv_ on this device"
    if torch.cuda.is_current_stream_capturing():  # a plan first built inside a capture
        return None
    try:
        store(plan, x[:1], positions[:1], torch.full((1,), -1, dtype=torch.long,
                                                     device=x.device))
        torch.cuda.synchronize(x.device)
    except Exception as e:  # noqa: BLE001 - any failure means: leave it to vLLM, say why
        return f"a first context_kv_ call failed ({type(e).__name__}: {str(e)[:200]})"
    return None


class DFlashOpsQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash drafter with the context K/V precompute on ``torch.ops.dflash``."""

    def precompute_and_store_context_kv(self, context_states: torch.Tensor,
                                        context_positions: torch.Tensor,
                                        context_slot_mapping=None) -> None:
        plan = self._dflash_ops_plan(context_states, context_positions) \
            if context_slot_mapping is not None else None
        if plan is None:  # compute only (vLLM's dummy runs), or a case we leave to vLLM
            return super().precompute_and_store_context_kv(context_states, context_positions,
                                                           context_slot_mapping)
        store(plan, context_states, context_positions, context_slot_mapping)

    def _dflash_ops_plan(self, x: torch.Tensor,
                         positions: torch.Tensor) -> Optional[ContextPlan]:
        m = self.model
        if not hasattr(m, "_num_attn_layers"):
            m._build_fused_kv_buffers()
        key = _plan_key(m, x)
        cached = getattr(self, "_dflash_ops_cached", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if not _device_ok(x):
            plan = _once("context precompute on %s: vLLM's own method runs (our kernels are "
                         "CUDA)", x.device.type)
        else:
            plan = build_plan(m, x)
            why = probe(plan, x, positions) if plan is not None else None
            if why is not None:
                plan = _once("%s: vLLM's own context precompute runs", why)
        self._dflash_ops_cached = (key, plan)
        if plan is not None:
            log.info("dflash_ops: context K/V precompute of %d layers on dflash.context_kv_ "
                     "(Hkv %d, D %d)", len(plan.k_caches), m._num_kv_heads, m._head_dim)
        return plan
