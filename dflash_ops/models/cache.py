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
        n = self._blocks_of(r, max_len)
        if n > len(self._free):
            raise RuntimeError(f"PagedKVCache.add_request: {n} blocks needed, "
                               f"{len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._owned[r] = blocks
        self._set_row(r, blocks)

    def _blocks_of(self, r: int, max_len: Optional[int]) -> int:
        # add_request's checks: slot r free and in the table, max_len within it; its blocks
        fn = f"{type(self).__name__}.add_request"
        if r in self._owned:
            raise ValueError(f"{fn}: request slot {r} is in use")
        if not 0 <= r < self.block_table.shape[0]:
            raise ValueError(f"{fn}: request slot {r} outside "
                             f"[0, {self.block_table.shape[0]})")
        n = self.max_blocks if max_len is None else -(-max_len // self.block_size)
        if n > self.max_blocks:
            raise ValueError(f"{fn}: max_len {max_len} needs {n} blocks, "
                             f"more than the table's {self.max_blocks}")
        return n

    def _set_row(self, r: int, blocks: List[int]) -> None:
        row = torch.full((self.max_blocks,), self.num_blocks, dtype=torch.int32)
        row[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[r].copy_(row)

    def blocks_needed(self, lengths: List[int]) -> int:
        """How many free blocks ``add_request`` would take for slots 0, 1, ... (all free) with
        ``lengths[i]`` positions each."""
        return sum(-(-n // self.block_size) for n in lengths)

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
        (negative, or past the request's blocks) or the request slot is outside the table."""
        requests = requests.long()
        positions = positions.long()
        col = torch.div(positions, self.block_size, rounding_mode="floor")
        n = self.block_table.shape[0]
        ok = (positions >= 0) & (col < self.max_blocks) & (requests >= 0) & (requests < n)
        blk = self.block_table[requests.clamp(0, n - 1),
                               col.clamp(0, self.max_blocks - 1)].long()
        ok &= (blk >= 0) & (blk < self.num_blocks)
        return torch.where(ok, blk * self.block_size + positions % self.block_size,
                           torch.full_like(positions, -1))

    def token_meta(self, requests: torch.Tensor, starts: torch.Tensor,
                   q_lens: Optional[torch.Tensor], total: int, block: int = 1) -> tuple:
        """A forward's per-token metadata without a host sync: request i (slot requests[i])
        has q_lens[i] new tokens (None: ``block`` each), grouped by request, the first at
        position starts[i]; ``total`` = T, their number. Returns (pos [T] int64, slots [T]
        int64 (as ``slots``), seq_lens [R] int32 = starts + q_lens, qsl [R + 1] int32 = each
        request's first row and T). On CUDA one Triton launch (``triton.loop.token_meta``,
        unless a backend other than triton is forced for the loop ops), where the torch
        version, ``token_meta_ref``, is ~30 small kernels a forward."""
        from .. import dispatch, triton

        if (requests.is_cuda and triton.AVAILABLE
                and dispatch.forced_backend("prepare_step_") in (None, "triton")):
            from ..triton.loop import token_meta

            r, dev = requests.shape[0], requests.device
            pos = torch.empty(total, dtype=torch.long, device=dev)
            slots = torch.empty(total, dtype=torch.long, device=dev)
            seq_lens = torch.empty(r, dtype=torch.int32, device=dev)
            qsl = torch.empty(r + 1, dtype=torch.int32, device=dev)
            token_meta(requests.long(), starts.long(),
                       None if q_lens is None else q_lens.long(), block, self.block_table,
                       self.block_size, self.num_blocks, pos, slots, seq_lens, qsl)
            return pos, slots, seq_lens, qsl
        return token_meta_ref(self, requests, starts, q_lens, total, block)


def token_meta_ref(cache: PagedKVCache, requests: torch.Tensor, starts: torch.Tensor,
                   q_lens: Optional[torch.Tensor], total: int, block: int = 1) -> tuple:
    """``PagedKVCache.token_meta`` in torch ops (the reference the Triton kernel is tested
    against)."""
    requests, starts = requests.long(), starts.long()
    r, dev = requests.shape[0], requests.device
    if q_lens is None:
        q_lens = torch.full((r,), block, dtype=torch.long, device=dev)
    q_lens = q_lens.long()
    qsl = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), q_lens.cumsum(0)])
    tok_req = torch.repeat_interleave(torch.arange(r, device=dev), q_lens, output_size=total)
    pos = starts[tok_req] + torch.arange(total, device=dev) - qsl[tok_req]
    return (pos, cache.slots(requests[tok_req], pos), (starts + q_lens).to(torch.int32),
            qsl.to(torch.int32))
