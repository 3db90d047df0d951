"""Building blocks of the families' ``samples(device, dtype)`` tables: seeded random tensors made
on the CPU (the same values on every device) and moved to the device."""
from __future__ import annotations

from typing import List

import torch

P = 32  # positions in a sample's cos/sin table
EPS = 1e-6


class Maker:
    """Tensors of one sample case: ``dtype`` for the floating inputs, drawn from ``seed``."""

    def __init__(self, seed: int, device, dtype: torch.dtype):
        self.g = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.dtype = dtype

    def rnd(self, *shape, dtype=None, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.g) * scale
        return x.to(dtype or self.dtype).to(self.device)

    def ints(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def positions(self, t: int, p: int = P) -> torch.Tensor:
        return torch.randint(0, p, (t,), generator=self.g).to(self.device)

    def cos_sin(self, rotary_dim: int, p: int = P) -> torch.Tensor:
        from .rope import make_cos_sin_cache
        return make_cos_sin_cache(p, rotary_dim, device=self.device)

    def caches(self, n_layers: int, nb: int, bs: int, hkv: int, d: int,
               head_major: bool = False) -> List[List[torch.Tensor]]:
        """(k_caches, v_caches): per-layer paged caches [nb, bs, Hkv, D]; ``head_major``: views
        into one [nb, Hkv, bs, 2*D] tensor per layer (K and V side by side, vLLM's layout)."""
        if not head_major:
            return ([self.rnd(nb, bs, hkv, d) for _ in range(n_layers)],
                    [self.rnd(nb, bs, hkv, d) for _ in range(n_layers)])
        kv = [self.rnd(nb, hkv, bs, 2 * d) for _ in range(n_layers)]
        return ([t[..., :d].permute(0, 2, 1, 3) for t in kv],
                [t[..., d:].permute(0, 2, 1, 3) for t in kv])


# --------------------------------------------------------------------------------------------
# Building blocks of the families' ``bad_samples()`` tables: mutations that break one argument of
# an op's first sample case (made on the CPU in fp32; tests move them to other devices). Each
# mutation is a function kw -> None that edits the keyword arguments in place.
# --------------------------------------------------------------------------------------------
META = "meta"  # a second device that exists on CPU-only machines, for device mismatches


def rnd(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def strided_last(*shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` whose last dimension has stride 2."""
    return torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]


def cos_sin(rotary_dim: int = 64, p: int = P) -> torch.Tensor:
    from .rope import make_cos_sin_cache
    return make_cos_sin_cache(p, rotary_dim)


def caches(n_layers=2, nb=4, bs=4, hkv=2, d=64, dtype=torch.float32) -> List[torch.Tensor]:
    return [rnd(nb, bs, hkv, d, dtype=dtype) for _ in range(n_layers)]


def positions(t: int) -> torch.Tensor:
    return torch.randint(0, P, (t,), dtype=torch.int64)


def set_(**changes):
    """Set each named argument to a value, or to ``fn(kw)`` where the value is callable."""
    def mutate(kw):
        for name, val in changes.items():
            kw[name] = val(kw) if callable(val) else val
    return mutate


def to(name, *, dtype=None, device=None):
    """Move argument ``name`` to another dtype and/or device."""
    return set_(**{name: lambda kw: kw[name].to(dtype=dtype, device=device)})


def item(name, i, val):
    """Replace element (or slice) i of the list argument ``name``; ``val`` may be fn(old)."""
    def mutate(kw):
        lst = list(kw[name])
        lst[i] = val(lst[i]) if callable(val) else val
        kw[name] = lst
    return mutate


def sliced(name, idx):
    """Replace argument ``name`` by ``kw[name][idx]`` (a slice or view of it)."""
    return set_(**{name: lambda kw: kw[name][idx]})


def both(*mutations):
    """All the mutations, in order."""
    def mutate(kw):
        for m in mutations:
            m(kw)
    return mutate
