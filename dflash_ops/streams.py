"""The side stream of the DFlash 2 drafter's one graph branch (``models.drafter``: the candidate
selector's hidden projection runs beside the LM head), one a device.

Kernels that keep per-device scratch between calls (``triton.context``'s split-K tile counters)
key it by ``on_side`` too, so a branch and the main stream never share it."""
from __future__ import annotations

import torch

_SIDE: dict = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The device's side stream (made on first use, then the same one)."""
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


def on_side(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is its side stream."""
    s = _SIDE.get(device) if device.type == "cuda" else None
    return s is not None and torch.cuda.current_stream(device) == s
