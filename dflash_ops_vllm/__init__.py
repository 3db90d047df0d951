"""The vLLM plugin's entry point: vLLM's own DFlash drafter with its context K/V precompute on
dflash_ops's ops.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process (API
server, engine core, workers). This package is top-level and imports neither ``dflash_ops`` nor
``torch.cuda``: loading the plugin costs no CUDA context, no kernel registration and no JIT build
in processes that never build the drafter. ``register`` puts ``DFlashOpsQwen3ForCausalLM``
(``dflash_ops/integrations/vllm/model.py``, imported by vLLM only where it builds the model) in
as the ``DFlashDraftModel`` architecture: vLLM's ``DFlashQwen3ForCausalLM`` with
``precompute_and_store_context_kv`` running ``torch.ops.dflash.context_kv_`` (one GEMM for every
layer, K RMSNorm, RoPE and the paged write of K and V, straight into each layer's vLLM cache
through strided views) instead of vLLM's GEMM, norm and rotary launches, a copy and one
cache-update launch per layer.

* ``DFLASH_OPS_VLLM=0`` disables it (vLLM runs untouched).
* Only the tested vLLM versions (``TESTED``) are patched; any other leaves vLLM untouched, with
  one log line.
* Quantized weights, a quantized (fp8) KV cache, a cache layout we do not know or no dflash_ops
  kernel on the device: that model runs vLLM's own method, with one log line.
* It also registers a draft attention backend (``integrations/vllm/attention.py``) into vLLM's
  ``AttentionBackendEnum.CUSTOM`` slot, chosen with ``"attention_backend": "CUSTOM"`` in the
  speculative config (unless another package holds that slot: one log line).
"""
from __future__ import annotations

import logging
import os

# vLLM versions the plugin is tested with: 0.25.x on the H200 (benchmarks/vllm/), 0.33.0 on
# CPU in CI (imports, registration, signatures, cache views).
TESTED = ("0.25.", "0.33.0")
ARCH = "DFlashDraftModel"
MODEL_CLS = "dflash_ops.integrations.vllm.model:DFlashOpsQwen3ForCausalLM"
BACKEND_CLS = "dflash_ops.integrations.vllm.attention.DFlashOpsAttentionBackend"

log = logging.getLogger("vllm.dflash_ops")  # under vLLM's logger: its handler and format
_state = {"registered": False}


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vllm")
    except PackageNotFoundError:
        return ""


def supported(ver: str) -> bool:
    """True for a vLLM version the plugin is tested with (``TESTED``: prefixes ending in a
    dot match a release series, others one release)."""
    base = ver.split("+")[0]
    return any(base.startswith(t) if t.endswith(".") else base == t for t in TESTED)


def enabled() -> bool:
    return os.environ.get("DFLASH_OPS_VLLM", "1").strip().lower() not in ("0", "false", "off",
                                                                           "no")


def register() -> bool:
    """The ``vllm.general_plugins`` entry point: register the DFlash override (idempotent, no
    CUDA). Returns whether the override is registered."""
    if _state["registered"]:
        return True
    if not enabled():
        log.info("dflash_ops: DFLASH_OPS_VLLM=0, vLLM's DFlash runs untouched")
        return False
    ver = vllm_version()
    if not supported(ver):
        log.warning("dflash_ops: vLLM %s is not a tested version (%s); vLLM's DFlash runs "
                    "untouched", ver or "(not installed)", ", ".join(TESTED))
        return False
    from vllm import ModelRegistry
    archs = _dflash_archs(ModelRegistry)
    for arch in archs:
        ModelRegistry.register_model(arch, MODEL_CLS)
    _state["registered"] = True
    log.info("dflash_ops: %s runs its context K/V precompute on torch.ops.dflash.context_kv_ "
             "(vLLM %s)", ", ".join(archs), ver)
    _register_backend()
    return True


def _dflash_archs(registry) -> list:
    """``ARCH`` and every other architecture vLLM maps to its ``DFlashQwen3ForCausalLM`` (0.33
    adds aliases), read from the registry's lazy entries (nothing imported)."""
    out = [ARCH]
    for arch, entry in sorted(getattr(registry, "models", {}).items()):
        if arch != ARCH and getattr(entry, "class_name", None) == "DFlashQwen3ForCausalLM" \
                and str(getattr(entry, "module_name", "")).endswith("qwen3_dflash"):
            out.append(arch)
    return out


def _register_backend() -> None:
    """Our draft attention backend into vLLM's CUSTOM slot (by path: nothing imported), unless
    another package holds that slot already."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    custom = AttentionBackendEnum.CUSTOM
    held = custom.is_overridden() and custom.get_path() != BACKEND_CLS
    if held:
        log.warning("dflash_ops: the CUSTOM attention backend is taken (%s); ours is not "
                    "registered", custom.get_path())
        return
    register_backend(custom, BACKEND_CLS)
    log.info("dflash_ops: draft attention backend \"CUSTOM\" (speculative_config "
             "attention_backend) runs torch.ops.dflash.block_attention")
