"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and later GPUs.

A kernel launched as a programmatic dependent may start while the grid before it in the stream
is still finishing: its CTAs are scheduled and run their set-up as the prior grid drains,
instead of after it (inside a CUDA graph too: the capture records the launch attribute as a
programmatic edge). Every Triton kernel here takes a ``PDL`` constexpr and, when it is set,
waits (``griddepcontrol.wait``: the prior grid complete and its writes visible) before its
first load or store, so nothing it reads or writes can race the prior grid. Some also let
their dependents launch early (``gdc_launch_dependents``, PTX
``griddepcontrol.launch_dependents``): the RMSNorm and RoPE kernels right after their wait
where the grid is one wave (``early_trigger``: the decode and verify steps' launches), the
split-K and one-tile-a-program GEMMs (``context._proj_splitk_kernel``,
``context._kv_proj_tile``; not the persistent launch) once a program's main loop is over. The
next grid then launches once every program of this one has got there or exited, and its
programs wait in their ``gdc_wait`` until this grid has completed: it overlaps this grid's
tail with its launch, never its memory.

``pdl_kwargs(device)``: the launch keywords, PDL on a CUDA device of compute capability >= 9
unless ``DFLASH_OPS_PDL=0`` (read at each launch, so set it before a graph is captured), off
in the interpreter and elsewhere. The CUDA kernels do the same through csrc/common.cuh's
``launch_kernel`` and ``pdl_wait`` (the variable read once a process there).
"""
from __future__ import annotations

import functools
import os

import torch

ENV = "DFLASH_OPS_PDL"
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    # NVIDIA sm_90+ only: a ROCm build reports its gfx9 GPUs as capability 9.x too, and the
    # griddepcontrol intrinsics are NVIDIA's
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def early_trigger(kw: dict, device: torch.device, programs: int) -> bool:
    """The TRIGGER constexpr of a launch with ``kw = pdl_kwargs(device)`` and ``programs``
    programs: let the next grid launch right after the wait only where PDL is on and the grid
    is one wave (at most a program an SM), so that a dependent grid's programs never hold SM
    slots a later wave of this grid needs (session 21 lost 2-5 us a call with a trigger at
    the start of a many-wave attention grid)."""
    if not kw["PDL"]:
        return False
    return programs <= _sms(device.index if device.index is not None
                            else torch.cuda.current_device())


def pdl_kwargs(device: torch.device) -> dict:
    """{"PDL": False} or {"PDL": True, "launch_pdl": True} for a launch on ``device``."""
    if device.type != "cuda" or os.environ.get("DFLASH_OPS_PDL", "1") == "0":
        return _OFF
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return _OFF
    return _ON if _hopper(device.index if device.index is not None
                          else torch.cuda.current_device()) else _OFF
