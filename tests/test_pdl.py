"""Programmatic dependent launch (dflash_ops/triton/_pdl.py): which launches use it, and that
every Triton kernel waits for its prior grid before anything else when it does (a kernel
launched as a dependent without that wait could read what the prior grid has not written
yet: a race no CPU test sees). The kernels' compiled waits: tests/test_triton_splitk_sm90.py,
tests/test_triton_sm90_report.py; on the GPU every test runs its Triton kernels with PDL."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

TRITON_DIR = Path(__file__).resolve().parents[1] / "dflash_ops" / "triton"


def test_pdl_kwargs(monkeypatch):
    pytest.importorskip("triton")
    from dflash_ops.triton import _pdl

    monkeypatch.delenv(_pdl.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _pdl.pdl_kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(_pdl, "_hopper", lambda index: index == 0)
    assert _pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert _pdl.pdl_kwargs(torch.device("cuda", 1)) == {"PDL": False}  # before sm_90
    monkeypatch.setenv(_pdl.ENV, "0")
    assert _pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.setenv(_pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": False}


def test_no_pdl_on_rocm(monkeypatch):
    """A ROCm build reports gfx9 GPUs as compute capability 9.x: PDL stays off there."""
    pytest.importorskip("triton")
    from dflash_ops.triton import _pdl

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert not _pdl._hopper.__wrapped__(0)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _pdl._hopper.__wrapped__(0)


def _jit_kernels(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                ast.unparse(d).endswith("jit") for d in node.decorator_list):
            yield node


def _before_the_wait(stmt) -> bool:
    """What may precede a kernel's PDL wait: index arithmetic (assignments that read, write or
    copy no memory) and the weight's L2 prefetch (`if PREFETCH ...:` calling _prefetch_l2 only:
    a hint that returns no data; test_triton_splitk_sm90 checks its PTX)."""
    text = ast.unparse(stmt)
    if isinstance(stmt, ast.Assign):
        return not any(w in text for w in ("load", "store", "atomic", "desc", "gdc_"))
    if isinstance(stmt, ast.If) and "PREFETCH" in ast.unparse(stmt.test):
        calls = [ast.unparse(c.func) for c in ast.walk(stmt) if isinstance(c, ast.Call)]
        return bool(calls) and all(c in ("_prefetch_l2", "tl.program_id", "tl.minimum")
                                   for c in calls)
    return False


def test_every_triton_kernel_waits_first_and_every_launch_passes_pdl():
    kernels = launches = 0
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = set()
        for fn in _jit_kernels(tree):
            names.add(fn.name)
            kernels += 1
            args = [a.arg for a in fn.args.args]
            assert "PDL" in args, f"{path.name}: {fn.name} takes no PDL"
            body = fn.body
            if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]  # the docstring
            while _before_the_wait(body[0]):
                body = body[1:]
            first = body[0]
            assert (isinstance(first, ast.If) and ast.unparse(first.test) == "PDL"
                    and ast.unparse(first.body[0]).endswith("gdc_wait()")), \
                f"{path.name}: {fn.name} does not wait for the prior grid first"
        for outer in ast.walk(tree):  # kernel[grid](...) calls, in the launching function
            if not isinstance(outer, ast.FunctionDef) or outer.name in names:
                continue
            # `kw = pdl_kwargs(...)` in the function: **kw is the launch's pdl_kwargs
            kw_names = {t.id for a in ast.walk(outer) if isinstance(a, ast.Assign)
                        and ast.unparse(a.value).startswith("pdl_kwargs(")
                        for t in a.targets if isinstance(t, ast.Name)}
            for node in ast.walk(outer):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                        and ast.unparse(node.func.value) in names):
                    launches += 1
                    assert any(k.arg is None and (ast.unparse(k.value).startswith("pdl_kwargs(")
                                                  or ast.unparse(k.value) in kw_names)
                               for k in node.keywords), \
                        f"{path.name}: a launch of {ast.unparse(node.func.value)} without " \
                        f"**pdl_kwargs(...)"
    assert kernels >= 20 and launches >= kernels, (kernels, launches)


# the Triton kernels of the decode chain that let their dependents launch early; the GEMMs
# (their tile helper, _kv_proj_tile) once their main loop is over, the others after the wait
TRIGGERS = {"_rms_norm_kernel", "_rope_kernel", "_rope_store_kernel", "_proj_splitk_kernel",
            "_kv_proj_tile"}


def test_triggers_only_under_pdl_and_after_the_wait():
    """griddepcontrol.launch_dependents (gdc_launch_dependents) lets the next grid launch
    before this one ends; it is safe because every dependent waits first (above), and only
    under ``if PDL:`` (a kernel launched without PDL has no dependents to let go)."""
    found = set()
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and ast.unparse(node.test) == "PDL":
                    calls = [ast.unparse(b) for b in node.body]
                    if any(c.endswith("gdc_launch_dependents()") for c in calls):
                        found.add(fn.name)
                        # in the kernel's first `if PDL:` (its wait), after the wait
                        assert calls[0].endswith("gdc_wait()") or not any(
                            c.endswith("gdc_wait()") for c in calls), \
                            f"{path.name}: {fn.name} triggers before its wait"
            src = ast.unparse(fn)
            n_all = src.count("gdc_launch_dependents()")
            n_pdl = sum(ast.unparse(b).count("gdc_launch_dependents()")
                        for node in ast.walk(fn) if isinstance(node, ast.If)
                        and ast.unparse(node.test) == "PDL" for b in node.body)
            assert n_all == n_pdl, f"{path.name}: {fn.name} triggers outside `if PDL:`"
    assert found == TRIGGERS, found


def test_early_trigger_only_with_pdl_and_one_wave(monkeypatch):
    pytest.importorskip("triton")
    from dflash_ops.triton import _pdl

    monkeypatch.setattr(_pdl, "_sms", lambda index: 4)
    dev = torch.device("cuda", 0)
    assert not _pdl.early_trigger({"PDL": False}, dev, 1)
    assert _pdl.early_trigger({"PDL": True, "launch_pdl": True}, dev, 4)
    assert not _pdl.early_trigger({"PDL": True, "launch_pdl": True}, dev, 5)


def test_every_launch_of_a_triggering_kernel_passes_early_trigger():
    """The kernels with a TRIGGER constexpr are launched with TRIGGER=early_trigger(launch,
    ...) and **launch, launch the same launch's pdl_kwargs: a trigger never without PDL, never
    on a grid of more than a wave."""
    n = 0
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {fn.name for fn in _jit_kernels(tree)
                 if "TRIGGER" in [a.arg for a in fn.args.args]}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and ast.unparse(node.func.value) in names):
                n += 1
                kws = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kws.get("TRIGGER", "").startswith("early_trigger(launch, "), kws
                assert kws.get(None) == "launch", kws
    assert n == 3, n


def _compile_norm(trigger: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_ops.triton import norm
    fn = norm._rms_norm_kernel
    consts = dict(FUSED_ADD=True, BLOCK_M=1, BLOCK_D=4096, INDEX_64=False, PDL=True,
                  TRIGGER=trigger)
    sig = {}
    for name in fn.arg_names:
        sig[name] = ("constexpr" if name in consts else "*bf16" if name.endswith("_ptr")
                     else "fp32" if name == "eps" else "i32")
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=8, launch_pdl=True)).asm["ptx"]


def test_norm_kernel_triggers_after_its_wait_before_its_loads():
    """sm_90 PTX (no GPU): with TRIGGER, launch_dependents right after the wait, before the
    first global load; without it, the wait alone."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile_norm(True)
    wait, trig = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert wait < trig < ptx.index("ld.global")
    plain = _compile_norm(False)
    assert "griddepcontrol.wait" in plain and "launch_dependents" not in plain


CSRC = Path(__file__).resolve().parents[1] / "csrc"


def test_every_cuda_kernel_waits_first_and_launches_through_launch_kernel():
    """csrc/: every __global__ kernel's first statement is pdl_wait() (common.cuh), and no
    kernel is launched with <<<>>> outside common.cuh's launch_kernel (which makes it a
    programmatic dependent where the binary's kernels were compiled for sm_90+ and run on
    one)."""
    import re

    kernels = 0
    for path in sorted(CSRC.glob("*.cu*")):
        text = path.read_text()
        for m in re.finditer(r"__global__", text):
            body = text[text.index("{", m.end()) + 1:].lstrip()
            kernels += 1
            assert body.startswith("pdl_wait();"), \
                f"{path.name}: a kernel at offset {m.start()} does not call pdl_wait() first"
        if path.name != "common.cuh":
            assert "<<<" not in text, f"{path.name}: a <<<>>> launch (use launch_kernel)"
    assert kernels >= 19, kernels
