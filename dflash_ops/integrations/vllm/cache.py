"""K/V views of one layer's vLLM paged cache in our cache layout, without vLLM.

Our ops take a cache ``[num_blocks, block_size, Hkv, D]`` with any strides and a unit last
stride, so each vLLM layout maps onto two strided views (no copy):

* ``(num_blocks, 2, block_size, Hkv, D)``: TRITON_ATTN and FLEX_ATTENTION in vLLM 0.25;
* ``(2, num_blocks, block_size, Hkv, D)``: K and V as two outer halves (no tested backend uses
  it today; kept for backends that do);
* ``(num_blocks, Hkv, block_size, 2 * D)``: K and V side by side (vLLM 0.33).

The layout is read from the tensor's shape (the backend may store it permuted: the strides are
whatever they are). ``(num_blocks, 2, ...)`` is tried first, so 2 blocks stay unambiguous for
the backends we run.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def kv_views(kv_cache: torch.Tensor, num_kv_heads: int,
             head_dim: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) ``[num_blocks, block_size, Hkv, D]`` views of ``kv_cache``, or None when its shape
    is none of the known layouts for (Hkv, D) or a view's last stride is not 1."""
    if isinstance(kv_cache, (list, tuple)):  # older vLLM: one cache per virtual engine
        kv_cache = kv_cache[0]
    if not isinstance(kv_cache, torch.Tensor):
        return None
    s = tuple(kv_cache.shape)
    hkv, d = num_kv_heads, head_dim
    k = v = None
    if len(s) == 5 and s[1] == 2 and s[3:] == (hkv, d):
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    elif len(s) == 5 and s[0] == 2 and s[3:] == (hkv, d):
        k, v = kv_cache[0], kv_cache[1]
    elif len(s) == 4 and s[1] == hkv and s[3] == 2 * d:
        k = kv_cache[..., :d].transpose(1, 2)
        v = kv_cache[..., d:].transpose(1, 2)
    if k is None or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    return k, v
