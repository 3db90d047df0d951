"""``dflash-ops check``: every op on its sample inputs, every available backend vs the reference.

The inputs are each family's ``samples(device, dtype)`` (drawn in the test dtype); the oracle is
the torch reference run on the same values upcast to fp32. What is compared: the op's result and
every argument it writes. A backend passes when its max error is at most twice the error of the
torch reference run in the test dtype, plus a small atol.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from . import dispatch
from .ops import samples


def _upcast(v):
    if isinstance(v, dict):
        return {k: _upcast(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_upcast(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.float() if v.is_floating_point() else v.clone()
    return v


def _outputs(info: dispatch.OpInfo, case: dict, result) -> List[torch.Tensor]:
    """The op's result and the tensors it wrote, as fp32."""
    outs = [result] if isinstance(result, torch.Tensor) else []
    for name in info.written:
        v = case[name]
        outs.extend(v if isinstance(v, (list, tuple)) else [v])
    return [o.float() for o in outs]


def _run(info: dispatch.OpInfo, case: dict, backend: str) -> List[torch.Tensor]:
    args, kwargs = info.call_args(case)
    with dispatch.use_backend(backend, ops=[info.name]):
        result = getattr(torch.ops.dflash, info.name).default(*args, **kwargs)
    return _outputs(info, case, result)


def _err(got: List[torch.Tensor], ref: List[torch.Tensor]) -> float:
    """Max abs difference; NaN where the reference is not NaN counts as infinite."""
    worst = 0.0
    for a, b in zip(got, ref):
        both_nan = torch.isnan(a) & torch.isnan(b)
        d = torch.where(both_nan, torch.zeros_like(a), (a - b).abs().nan_to_num(float("inf")))
        worst = max(worst, d.max().item() if d.numel() else 0.0)
    return worst


def run(device: str = None, dtype: torch.dtype = None, backends: List[str] = None) -> List[Dict]:
    """One row per (op, sample case, backend): max error vs the fp32 reference, the allowed
    bound, pass/fail."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float16)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    rows = []
    for op, info in sorted(dispatch.ops().items()):
        for case_name in samples(device, dtype)[op]:
            def case():  # fresh inputs each run: ops write their arguments
                return samples(device, dtype)[op][case_name]

            ref = _run(info, _upcast(case()), "torch")
            base_err = _err(_run(info, case(), "torch"), ref)
            scale = max([1.0] + [r.abs().nan_to_num(0).max().item() for r in ref if r.numel()])
            bound = 2 * base_err + 1e-5 * scale
            cands = backends or [b for b in dispatch.available_backends(op) if kind == "cuda"
                                 or b == "torch" or (b == "triton" and dispatch._interpret())]
            for backend in cands:
                row = {"op": op, "case": case_name, "backend": backend, "device": device,
                       "dtype": str(dtype).replace("torch.", ""), "bound": bound}
                try:
                    got = _run(info, case(), backend)
                    nan = any(bool(torch.isnan(g).any() and not torch.isnan(r).any())
                              for g, r in zip(got, ref))
                    err = _err(got, ref)
                    row.update(err=err, ok=(err <= bound and not nan))
                except dispatch.BackendUnavailableError as e:
                    row.update(err=float("nan"), ok=None,
                               note=str(e).split(":")[0] + ": unavailable")
                except Exception as e:  # noqa: BLE001 - report, then fail the run
                    row.update(err=float("nan"), ok=False, note=f"{type(e).__name__}: {e}"[:120])
                rows.append(row)
    return rows


def format_table(rows: List[Dict]) -> str:
    head = (f"{'op':<22} {'case':<24} {'backend':<8} {'dtype':<9} {'max err':>10} {'bound':>10}"
            f"  result")
    lines = [head, "-" * len(head)]
    for r in rows:
        res = {True: "ok", False: "MISMATCH", None: "skipped"}[r["ok"]]
        if r.get("note"):
            res += f"  ({r['note']})"
        lines.append(f"{r['op']:<22} {r['case']:<24} {r['backend']:<8} {r['dtype']:<9} "
                     f"{r['err']:>10.3e} {r['bound']:>10.3e}  {res}")
    return "\n".join(lines)
