"""``dflash-ops check``: every op on random inputs, every available backend vs the reference.

For each op the inputs are drawn in the test dtype; the oracle is the torch reference run on
the same values upcast to fp32. A backend passes when its max error is at most twice the error
of the torch reference run in the test dtype, plus a small atol (DESIGN.md's rule).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch

from . import dispatch
from .ops.rope import make_cos_sin_cache


def _inputs(op: str, device, dtype, gen) -> Callable:
    """Returns make(dt) -> (args, outputs_fn): the same random values (drawn in ``dtype``) as
    ``dt`` tensors each call; outputs_fn(op_result) lists the tensors to compare."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    t, l, hq, hkv, d, h = 33, 5, 16, 4, 128, 512
    cache = make_cos_sin_cache(4096, d, 1e6, device=device)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(device)
    nb, bs = 32, 16
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(device)
    slots[::5] = -1
    raw = {
        "x2d": rnd(t, 40, d), "w2d": rnd(5, d), "xh": rnd(t, h), "res": rnd(t, h), "wh": rnd(h),
        "q": rnd(t, hq, d), "k": rnd(t, hkv, d), "wd": rnd(d), "wd2": rnd(d),
        "kv": rnd(t, l, 2, hkv, d), "wl": rnd(l, d), "kc": rnd(l, nb, bs, hkv, d),
        "vc": rnd(l, nb, bs, hkv, d), "wkv": rnd(l * 2 * hkv * d, h) / math.sqrt(h),
        "bias": rnd(l * 2 * hkv * d),
    }
    seq_lens = torch.tensor([17, 100, 40], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 16, 32, 33], dtype=torch.int32, device=device)
    bt = torch.randperm(nb, generator=gen)[:3 * 7].view(3, 7).to(torch.int32).to(device)
    # silu_mul: rows wider than 2*I (a slice of a wider output); drawn last, after the others
    raw["gate_up"] = rnd(t, 2 * 3 * h + 64)

    def make(dt):
        v = {k: x.to(dtype).to(dt) for k, x in raw.items()}
        kcs, vcs = list(v["kc"].unbind(0)), list(v["vc"].unbind(0))
        if op == "rms_norm":
            return (v["x2d"], v["w2d"], 1e-6), lambda r: [r]
        if op == "fused_add_rms_norm_":
            return (v["xh"], v["res"], v["wh"], 1e-6), lambda r: [v["xh"], v["res"]]
        if op == "rope_":
            return (v["q"], pos, cache, True), lambda r: [v["q"]]
        if op == "qk_norm_rope_":
            return (v["q"], v["k"], v["wd"], v["wd2"], pos, cache, 1e-6, True), \
                lambda r: [v["q"], v["k"]]
        if op == "knorm_rope_":
            kview = v["kv"][:, :, 0]
            return (kview, v["wl"], pos, cache, 1e-6, False), lambda r: [v["kv"]]
        if op == "store_kv_":
            return (v["kv"][:, :, 0], v["kv"][:, :, 1], kcs, vcs, slots), \
                lambda r: [v["kc"], v["vc"]]
        if op == "kv_proj":
            return (v["xh"], v["wkv"], v["bias"]), lambda r: [r]
        if op == "context_kv_":
            return (v["xh"], v["wkv"], None, v["wl"], pos, cache, slots, kcs, vcs, 1e-6, True,
                    v["wh"]), lambda r: [v["kc"], v["vc"]]
        if op == "block_attention":
            kc0, vc0 = kcs[0], vcs[0]
            return (v["q"], kc0, vc0, bt, seq_lens, qsl, d ** -0.5, False, -1, None), \
                lambda r: [r]
        if op == "block_attention_out_":
            out = torch.full_like(v["q"], float("nan"))
            return (v["q"], kcs[0], vcs[0], bt, seq_lens, qsl, d ** -0.5, True, 64, None,
                    out), lambda r: [out]
        if op == "silu_mul":
            return (v["gate_up"][:, :2 * 3 * h],), lambda r: [r]
        raise KeyError(op)
    return make


def _call(op: str, args):
    fn = getattr(torch.ops.dflash, op).default
    if op == "block_attention_out_":
        return fn(*args[:-1], out=args[-1])
    return fn(*args)


def run(device: str = None, dtype: torch.dtype = None, backends: List[str] = None) -> List[Dict]:
    """One row per (op, backend): max error vs the fp32 reference, the allowed bound, pass/fail."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float16)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    rows = []
    for op in sorted(dispatch.ops()):
        gen = torch.Generator().manual_seed(1234)
        make = _inputs(op, device, dtype, gen)
        with dispatch.use_backend("torch", ops=[op]):
            args, outs = make(torch.float32)
            ref = [o.float() for o in outs(_call(op, args))]
            args, outs = make(dtype)
            base = [o.float() for o in outs(_call(op, args))]
        base_err = max((a - b).abs().nan_to_num(0).max().item() for a, b in zip(base, ref))
        scale = max(1.0, max(r.abs().nan_to_num(0).max().item() for r in ref))
        bound = 2 * base_err + 1e-5 * scale
        cands = backends or [b for b in dispatch.available_backends(op) if kind == "cuda" or b ==
                             "torch" or (b == "triton" and dispatch._interpret())]
        for backend in cands:
            row = {"op": op, "backend": backend, "device": device,
                   "dtype": str(dtype).replace("torch.", ""), "bound": bound}
            try:
                with dispatch.use_backend(backend, ops=[op]):
                    args, outs = make(dtype)
                    got = [o.float() for o in outs(_call(op, args))]
                nan = any(bool(torch.isnan(g).any() and not torch.isnan(r).any())
                          for g, r in zip(got, ref))
                err = max((a - b).abs().nan_to_num(float("inf")).max().item()
                          for a, b in zip(got, ref))
                row.update(err=err, ok=(err <= bound and not nan))
            except dispatch.BackendUnavailableError as e:
                row.update(err=float("nan"), ok=None, note=str(e).split(":")[0] + ": unavailable")
            except Exception as e:  # noqa: BLE001 - report, then fail the run
                row.update(err=float("nan"), ok=False, note=f"{type(e).__name__}: {e}"[:120])
            rows.append(row)
    return rows


def format_table(rows: List[Dict]) -> str:
    head = f"{'op':<22} {'backend':<8} {'dtype':<9} {'max err':>10} {'bound':>10}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        res = {True: "ok", False: "MISMATCH", None: "skipped"}[r["ok"]]
        if r.get("note"):
            res += f"  ({r['note']})"
        lines.append(f"{r['op']:<22} {r['backend']:<8} {r['dtype']:<9} {r['err']:>10.3e} "
                     f"{r['bound']:>10.3e}  {res}")
    return "\n".join(lines)
