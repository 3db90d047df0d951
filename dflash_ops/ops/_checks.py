"""Argument checks shared by the fake kernels, the reference and the Triton launchers.

Each raises ValueError naming the op, the argument and the expected vs given value.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(op: str, msg: str):
    raise ValueError(f"dflash.{op}: {msg}")


def _dtype_names(dtypes) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(op: str, name: str, t, *, rank=None, dtype=None, device=None, shape=None,
           last_contiguous: bool = False, contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument. ``rank`` an int or a tuple of allowed ranks; ``dtype`` a dtype
    or tuple; ``shape`` a tuple with None for free dims; ``last_contiguous``: stride(-1) == 1;
    ``contiguous``: ``t.is_contiguous()`` (kernels that index it as a flat array)."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if rank is not None:
        ranks = (rank,) if isinstance(rank, int) else tuple(rank)
        if t.dim() not in ranks:
            want = " or ".join(str(r) for r in ranks)
            fail(op, f"{name} must have rank {want}, got rank {t.dim()} (shape {tuple(t.shape)})")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            fail(op, f"{name} must be {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        fail(op, f"{name} must be on {device}, got {t.device}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            fail(op, f"{name} must have shape {want}, got {list(t.shape)}")
    if last_contiguous and t.numel() > 0 and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(op, f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if contiguous and not t.is_contiguous():
        fail(op, f"{name} must be contiguous, got shape {list(t.shape)} strides "
                 f"{list(t.stride())}")
    return t


def merged_leading_dims(t: torch.Tensor) -> tuple:
    """(sizes, strides) of t's leading dims (all but the last), size-1 dims dropped and each dim
    merged into the one before it where their strides allow (outermost first)."""
    sizes, strides = [], []
    for s, st in zip(t.shape[:-1], t.stride()[:-1]):
        if s == 1:
            continue
        if sizes and strides[-1] == st * s:
            sizes[-1] *= s
            strides[-1] = st
        else:
            sizes.append(s)
            strides.append(st)
    return sizes, strides


def _span(t: torch.Tensor) -> tuple:
    """[first, last) byte addresses t's elements occupy."""
    if t.numel() == 0:
        return 0, 0
    last = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr() - sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if st < 0)
    return start, start + (last + 1) * t.element_size()


def no_overlap(op: str, name: str, t: torch.Tensor, other_name: str, other: torch.Tensor):
    """t (written) and other must not share memory (address ranges, same device; tensors
    without storage, fake or meta, are not checked)."""
    if t.device != other.device or t.device.type == "meta":
        return
    try:
        if not t.data_ptr() or not other.data_ptr():
            return
    except RuntimeError:  # no storage (a fake tensor under tracing)
        return
    a0, a1 = _span(t)
    b0, b1 = _span(other)
    if a0 < b1 and b0 < a1:
        fail(op, f"{name} must not overlap {other_name} (a kernel writes {name} while it reads "
                 f"{other_name})")


def same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor):
    if t.dtype != ref.dtype:
        fail(op, f"{name} must have the dtype of {ref_name} ({str(ref.dtype).replace('torch.', '')}),"
                 f" got {str(t.dtype).replace('torch.', '')}")


def eps(op: str, value: float, name: str = "eps"):
    if not (value >= 0.0):
        fail(op, f"{name} must be >= 0, got {value}")


def head_dim(op: str, name: str, d: int, allowed: Sequence[int] = ()):
    if allowed and d not in allowed:
        fail(op, f"{name} head_dim must be one of {list(allowed)}, got {d}")


def cos_sin_cache(op: str, cache: torch.Tensor, head_size: int, device) -> int:
    """cos_sin_cache [P, R] fp32, R even and <= head_size; returns R (the rotary dims)."""
    tensor(op, "cos_sin_cache", cache, rank=2, dtype=torch.float32, device=device)
    r = cache.shape[1]
    if cache.shape[0] == 0:
        fail(op, "cos_sin_cache must have at least one position row, got shape [0, R]")
    if r % 2 != 0 or r == 0 or r > head_size:
        fail(op, f"cos_sin_cache must have an even number of columns R with 0 < R <= head_dim "
                 f"({head_size}), got R = {r}")
    return r


def index_vector(op: str, name: str, t, n: int, device, dtype=torch.int64):
    tensor(op, name, t, rank=1, dtype=dtype, device=device)
    if t.shape[0] != n:
        fail(op, f"{name} must have {n} entries (one per token), got {t.shape[0]}")


def caches(op: str, name: str, lst, n_layers: int, *, num_heads: int, head_size: int,
           dtype: torch.dtype, device) -> None:
    """A list of L paged caches [num_blocks, block_size, Hkv, D], any strides, last dim unit."""
    if not isinstance(lst, (list, tuple)):
        fail(op, f"{name} must be a list of {n_layers} tensors, got {type(lst).__name__}")
    if len(lst) != n_layers:
        fail(op, f"{name} must hold one cache per layer ({n_layers}), got {len(lst)}")
    first = None
    for i, c in enumerate(lst):
        tensor(op, f"{name}[{i}]", c, rank=4, dtype=dtype, device=device, last_contiguous=True)
        if c.shape[2] != num_heads or c.shape[3] != head_size:
            fail(op, f"{name}[{i}] must have shape [num_blocks, block_size, {num_heads}, "
                     f"{head_size}] (Hkv, D), got {list(c.shape)}")
        if first is None:
            first = c
        elif c.shape != first.shape:
            fail(op, f"{name}[{i}] has shape {list(c.shape)} but {name}[0] has {list(first.shape)}")
