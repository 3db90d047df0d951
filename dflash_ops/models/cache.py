"""A paged KV cache for the drafter: one [num_blocks, block_size, Hkv, D] K and V tensor per layer
and a block table per request.

Layout (``layout=`` or ``DFLASH_OPS_KV_LAYOUT``): ``"token"`` (the default) stores the tensors
as shaped, each token's Hkv heads side by side (vLLM's layout); ``"head"`` stores them as
[num_blocks, Hkv, block_size, D] and exposes the [num_blocks, block_size, Hkv, D] view (strided;
every op takes it), so one head's rows of a block are one contiguous run (4 KB at block 16,
D 128) for attention to read. Which is faster is measured in benchmarks/NOTES.md.

Request r's token at position p lives in block ``block_table[r, p // block_size]``, row
``p % block_size``, i.e. at slot ``block_table[r, p // block_size] * block_size + p %
block_size``. Blocks are handed out from a free list when a request is added (enough for its
``max_len`` positions) and returned when it is freed; the tables are device tensors, so slots
are computed on the device (no host sync) from positions.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

LAYOUTS = ("token", "head")


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, max_requests: int, max_len: int, dtype: torch.dtype,
                 device=None, layout: Optional[str] = None):
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"PagedKVCache: block_size and num_blocks must be > 0, got "
                             f"{block_size} and {num_blocks}")
        if layout is None:
            layout = os.environ.get("DFLASH_OPS_KV_LAYOUT", "token").strip() or "token"
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache: layout (or DFLASH_OPS_KV_LAYOUT) must be one of "
                             f"{LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks = -(-max_len // block_size)

        def alloc() -> torch.Tensor:
            if layout == "head":
                return torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype,
                                   device=device).transpose(1, 2)
            return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                               device=device)

        self.k: List[torch.Tensor] = [alloc() for _ in range(num_layers)]
        self.v: List[torch.Tensor] = [alloc() for _ in range(num_layers)]
        # unused entries point past the cache (num_blocks): their keys are never visible
        self.block_table = torch.full((max_requests, self.max_blocks), num_blocks,
                                      dtype=torch.int32, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict = {}

    def add_request(self, r: int, max_len: Optional[int] = None) -> None:
        """Give request slot ``r`` blocks for ``max_len`` positions (default: the maximum)."""
        if r in self._owned:
            raise ValueError(f"PagedKVCache.add_request: request slot {r} is in use")
        if not 0 <= r < self.block_table.shape[0]:
            raise ValueError(f"PagedKVCache.add_request: request slot {r} outside "
                             f"[0, {self.block_table.shape[0]})")
        n = self.max_blocks if max_len is None else -(-max_len // self.block_size)
        if n > self.max_blocks:
            raise ValueError(f"PagedKVCache.add_request: max_len {max_len} needs {n} blocks, "
                             f"more than the table's {self.max_blocks}")
        if n > len(self._free):
            raise RuntimeError(f"PagedKVCache.add_request: {n} blocks needed, "
                               f"{len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._owned[r] = blocks
        row = torch.full((self.max_blocks,), self.num_blocks, dtype=torch.int32)
        row[:n] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[r].copy_(row)

    def free_request(self, r: int) -> None:
        self._free.extend(reversed(self._owned.pop(r)))
        self.block_table[r].fill_(self.num_blocks)

    def slots(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 slots of (request, position) pairs; -1 where the position has no block
        (negative, or past the request's blocks)."""
        requests = requests.long()
        positions = positions.long()
        col = torch.div(positions, self.block_size, rounding_mode="floor")
        ok = (positions >= 0) & (col < self.max_blocks)
        blk = self.block_table[requests, col.clamp(0, self.max_blocks - 1)].long()
        ok &= blk < self.num_blocks
        return torch.where(ok, blk * self.block_size + positions % self.block_size,
                           torch.full_like(positions, -1))
