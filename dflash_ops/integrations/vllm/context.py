"""The plugin's context K/V precompute on ``torch.ops.dflash.context_kv_``, without vLLM.

``ContextPlan`` holds what one drafter's precompute needs (stacked weights, the fp32 RoPE table,
every layer's K/V cache views; ``fold_hidden_norm`` folds the hidden norm's weight into the
stacked weight); ``store`` writes one step's context rows. vLLM passes the slots
as one tensor (every layer), a per-layer list (one tensor per layer or None: that layer writes
nothing) or None (compute only); the list's entries usually share one buffer (one KV-cache
group), which is one fused call; otherwise each layer is its own call on its rows of w_kv.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Union

import torch

from ...ops.context import context_kv_

Slots = Union[torch.Tensor, Sequence[Optional[torch.Tensor]], None]


@dataclass
class ContextPlan:
    w_kv: torch.Tensor  # [L * 2 * Hkv * D, H], layer-major, K rows then V rows
    bias: Optional[torch.Tensor]  # [L * 2 * Hkv * D] or None
    k_weight: torch.Tensor  # [L, D]
    hidden_norm_weight: Optional[torch.Tensor]  # [H]
    cos_sin: torch.Tensor  # [P, R] fp32
    k_caches: List[torch.Tensor]  # L views [num_blocks, block_size, Hkv, D]
    v_caches: List[torch.Tensor]
    eps: float
    is_neox: bool
    hidden_rms: bool = False  # the hidden norm's weight is folded into w_kv (fold_hidden_norm)

    @property
    def rows_per_layer(self) -> int:
        return self.w_kv.shape[0] // len(self.k_caches)


def fold_hidden_norm(plan: ContextPlan) -> ContextPlan:
    """The plan with its hidden norm's weight folded into w_kv's columns (a new tensor of
    w_kv's size, rounded once) and ``hidden_rms`` on: ``context_kv_`` then divides the GEMM's
    rows by rms(x) itself, with no norm pass (one launch fewer a call on the GPU, up to 256
    rows). A plan without a hidden norm is returned as it is."""
    if plan.hidden_norm_weight is None:
        return plan
    return replace(plan, w_kv=plan.w_kv * plan.hidden_norm_weight[None, :],
                   hidden_norm_weight=None, hidden_rms=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device)


def store(plan: ContextPlan, x: torch.Tensor, positions: torch.Tensor, slots: Slots) -> None:
    """Project x [T, H] to every layer's K/V (hidden norm, GEMM, K-norm, RoPE at ``positions``)
    and write them at ``slots`` (a slot < 0 is skipped). Graph-capturable: no host sync."""
    if slots is None:
        return  # compute only, and nothing of it is observable: skip
    if isinstance(slots, torch.Tensor):
        context_kv_(x, plan.w_kv, plan.bias, plan.k_weight, positions, plan.cos_sin, slots,
                    plan.k_caches, plan.v_caches, plan.eps, plan.is_neox,
                    plan.hidden_norm_weight, plan.hidden_rms)
        return
    slots = list(slots)
    if len(slots) != len(plan.k_caches):
        raise ValueError(f"dflash_ops vLLM plugin: context_slot_mapping must hold one entry per "
                         f"draft layer ({len(plan.k_caches)}), got {len(slots)}")
    first = slots[0]
    if first is not None and all(s is not None and _same(s, first) for s in slots):
        store(plan, x, positions, first)
        return
    n = plan.rows_per_layer
    for i, s in enumerate(slots):
        if s is None:
            continue
        rows = slice(i * n, (i + 1) * n)
        context_kv_(x, plan.w_kv[rows], None if plan.bias is None else plan.bias[rows],
                    plan.k_weight[i:i + 1], positions, plan.cos_sin, s, [plan.k_caches[i]],
                    [plan.v_caches[i]], plan.eps, plan.is_neox, plan.hidden_norm_weight,
                    plan.hidden_rms)
