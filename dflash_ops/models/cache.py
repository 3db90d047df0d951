"""A paged KV cache (the drafter's and the target's): one [num_blocks, block_size, Hkv, D] K and V
tensor per layer, each token's Hkv heads side by side (vLLM's layout), and a block table per
request.

Request r's token at position p lives in block ``block_table[r, p // block_size]``, row
``p % block_size``, i.e. at slot ``block_table[r, p // block_size] * block_size + p %
block_size``. Blocks are handed out from a free list when a request is added (enough for its
``max_len`` positions) and returned when it is freed; the tables are device tensors, so slots
are computed on the device (no host sync) from positions.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, max_requests: int, max_len: int, dtype: torch.dtype,
                 device=None):
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"PagedKVCache: block_size and num_blocks must be > 0, got "
                             f"{block_size} and {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks = -(-max_len // block_size)

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device)
                                      for _ in range(num_layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device)
                                      for _ in range(num_layers)]
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

    def in_use(self) -> list:
        """The request slots that hold blocks, sorted."""
        return sorted(self._owned)

    def free_blocks(self) -> int:
        """How many blocks no request holds."""
        return len(self._free)

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
