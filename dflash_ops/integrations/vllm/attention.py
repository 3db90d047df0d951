"""A draft-only vLLM attention backend on ``torch.ops.dflash.block_attention``.

Registered by ``register()`` into vLLM's ``AttentionBackendEnum.CUSTOM`` slot (the enum is fixed:
"CUSTOM" is the one name a third-party backend gets) and chosen for the drafter with
``"attention_backend": "CUSTOM"`` in the speculative config. It is vLLM's TRITON_ATTN backend
(a subclass: its cache shape and layouts, its metadata builder with CUDA-graph support ALWAYS,
its per-version plumbing) with the two calls that touch the cache replaced:

* ``forward``: our ``block_attention`` over vLLM's paged cache (K/V views, any layout
  ``cache.kv_views`` knows), non-causal or causal as vLLM's metadata says, the layer's sliding
  window (vLLM's W: keys with ``|pos - j| < W``, ``pos - j < W`` when causal, as ours) and sinks;
* ``do_kv_cache_update``: our ``store_kv_`` into the same views.

What our kernels do not do is refused when vLLM builds the layer (configuration time), by
vLLM's own ``supports_*`` checks (head size, KV-cache dtype, attention type, multimodal prefix,
batch invariance, per-head quant scales, R-SWA, ALiBi sqrt, compute capability < 8.0) or, for what those do not cover, by a ValueError from
the impl's constructor naming the feature (ALiBi, logits soft cap, chunked lookback, a sliding
window of another attention type). A per-request causal tensor in the metadata is refused at
the first forward.
"""
from __future__ import annotations

from typing import Optional

import torch
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ...ops.attention import block_attention
from ...ops.kv import store_kv_
from ...ops.rope import HEAD_DIMS
from .cache import kv_views

NAME = "CUSTOM"
CACHE_DTYPES = ["auto", "float16", "bfloat16"]


def _refuse(what: str) -> ValueError:
    return ValueError(f"dflash_ops attention backend (CUSTOM): {what} is not supported; use "
                      f"another draft attention_backend (e.g. TRITON_ATTN)")


class DFlashOpsAttentionImpl(TritonAttentionImpl):
    """TRITON_ATTN's impl with forward / do_kv_cache_update on torch.ops.dflash."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None:
            raise _refuse("ALiBi")
        if self.logits_soft_cap:
            raise _refuse(f"logits soft cap {self.logits_soft_cap}")
        if getattr(self, "chunk_lookback", -1) != -1:
            raise _refuse(f"chunk_lookback {self.chunk_lookback}")
        if getattr(self, "use_alibi_sqrt", False):
            raise _refuse("ALiBi (sqrt)")
        if self.head_size not in HEAD_DIMS:
            raise _refuse(f"head size {self.head_size} (ours: {list(HEAD_DIMS)})")
        if str(self.kv_cache_dtype) not in CACHE_DTYPES:
            raise _refuse(f"KV cache dtype {self.kv_cache_dtype}")
        left, right = self.sliding_window
        if right not in (0, -1):
            raise _refuse(f"sliding window {self.sliding_window} (a right window)")
        self.window = left + 1 if left >= 0 else -1  # vLLM's W: (W - 1, 0)
        self._sinks32: Optional[torch.Tensor] = None

    def _sinks(self) -> Optional[torch.Tensor]:
        """The layer's sinks as the fp32 contiguous [Hq] our op takes: a persistent buffer
        refreshed every call (one tiny copy, graph-safe: vLLM loads and reloads the sinks in
        place, so a copy taken once would go stale)."""
        if self.sinks is None:
            return None
        if self._sinks32 is None or self._sinks32.device != self.sinks.device:
            self._sinks32 = torch.empty(self.sinks.shape, dtype=torch.float32,
                                        device=self.sinks.device)
        self._sinks32.copy_(self.sinks.detach())
        return self._sinks32

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise _refuse("fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        causal = attn_metadata.causal
        if isinstance(causal, torch.Tensor):
            raise _refuse("per-request causal flags")
        if getattr(attn_metadata, "use_cascade", False):
            raise _refuse("cascade attention")
        if getattr(attn_metadata, "rswa_prefix_lens", None) is not None:
            raise _refuse("R-SWA (rswa_prefix_lens)")
        if getattr(attn_metadata, "mm_prefix_range_tensor", None) is not None:
            raise _refuse("multimodal prefix ranges")
        views = kv_views(kv_cache, self.num_kv_heads, self.head_size)
        if views is None:
            raise _refuse(f"KV cache layout {list(kv_cache.shape)}")
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        seq_lens = attn_metadata.seq_lens  # the table may hold more rows than requests
        block_attention(q, views[0], views[1], attn_metadata.block_table[:seq_lens.shape[0]],
                        seq_lens, attn_metadata.query_start_loc, self.scale,
                        bool(causal), self.window, self._sinks(), out=out)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        views = kv_views(kv_cache, self.num_kv_heads, self.head_size)
        if views is None:
            raise _refuse(f"KV cache layout {list(kv_cache.shape)}")
        t = slot_mapping.shape[0]  # key may hold padded rows past the slots
        k = key[:t].view(t, 1, self.num_kv_heads, self.head_size)
        v = value[:t].view(t, 1, self.num_kv_heads, self.head_size)
        store_kv_(k, v, [views[0]], [views[1]], slot_mapping)


class DFlashOpsAttentionBackend(TritonAttentionBackend):
    """vLLM's TRITON_ATTN backend with its impl on torch.ops.dflash (the drafter's layers)."""

    supported_kv_cache_dtypes = list(CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        return DFlashOpsAttentionImpl

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in HEAD_DIMS

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return getattr(attn_type, "value", attn_type) == "decoder"  # the drafter's layers

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_rswa(cls) -> bool:  # 0.33's R-SWA masks: not in our kernel
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        major = getattr(capability, "major", None)
        return major is None or major >= 8  # mma.sync / Triton tl.dot
