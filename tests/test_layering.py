"""The package's layers import downwards only: the kernels (``ops``, ``triton``) know nothing of
the models, the models nothing of the loop that drives them (``speculator``) or the
benchmarks, and the vLLM plugin (``integrations``) sits on the ops alone. Every module's imports are read with ``ast``, those inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dflash_ops"

# package -> the packages it must not import
_TOP = ("dflash_ops.speculator", "dflash_ops.bench", "dflash_ops.integrations")
FORBIDDEN = {
    "dflash_ops.ops": ("dflash_ops.models",) + _TOP,
    "dflash_ops.triton": ("dflash_ops.models",) + _TOP,
    "dflash_ops.models": _TOP,
    # the vLLM plugin sits on the ops only (vLLM brings its own model and loop)
    "dflash_ops.integrations": ("dflash_ops.models", "dflash_ops.speculator", "dflash_ops.bench"),
}


def imported(source: str, module: str, is_package: bool = False) -> set:
    """Every module ``source`` (the code of ``module``) imports, anywhere in it: ``import a.b``
    gives a.b; ``from a import b`` gives a and a.b (b may be a submodule); relative imports are
    resolved against ``module``."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if package else parts), path, package


def _violations(module: str, names: set) -> list:
    bad = []
    for layer, banned in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            bad += sorted(n for n in names for b in banned if n == b or n.startswith(b + "."))
    return bad


def test_imports_go_downwards():
    found = {}
    for module, path, package in _modules():
        bad = _violations(module, imported(path.read_text(), module, package))
        if bad:
            found[module] = bad
    assert not found, found


@pytest.mark.parametrize("code", [
    "from ..speculator.draft_step import DraftStep",
    "def f():\n    from ..speculator import loop\n",
    "def f():\n    from .. import speculator\n",
    "import dflash_ops.speculator.loop",
    "class C:\n    def m(self):\n        from dflash_ops.bench import e2e\n",
])
def test_a_models_to_speculator_import_is_caught(code):
    names = imported(code, "dflash_ops.models.drafter")
    assert _violations("dflash_ops.models.drafter", names), names


def test_relative_imports_resolve():
    assert "dflash_ops.ops.loop" in imported("from ..ops.loop import x",
                                             "dflash_ops.speculator.step")
    assert "dflash_ops.models.cache" in imported("from .cache import C", "dflash_ops.models",
                                                 is_package=True)
    assert not _violations("dflash_ops.models.target",
                           imported("from ..ops.rope import r\nfrom .layer import L",
                                    "dflash_ops.models.target"))


def test_the_vllm_entry_point_package_imports_no_dflash_ops():
    """``dflash_ops_vllm`` (the entry point vLLM loads in every process) imports nothing of
    dflash_ops, so loading the plugin costs no kernel registration, extension load or CUDA."""
    path = PKG.parent / "dflash_ops_vllm" / "__init__.py"
    names = imported(path.read_text(), "dflash_ops_vllm", is_package=True)
    assert not [n for n in names if n.split(".")[0] in ("dflash_ops", "torch")], names
