"""Op families: each module defines its ops (schema, checks, torch reference, fake kernel, default
backend), their Python wrappers (its ``__all__``, re-exported here and by ``dflash_ops``),
``samples(device, dtype)``, the table of valid inputs that ``dflash-ops check`` and the op tests
draw from, and ``bad_samples()``, the breaks of those inputs that tests/test_bad_inputs.py expects
each op to reject. Importing this package defines every op."""
import importlib

FAMILIES = ("norm", "rope", "kv", "context", "attention", "act", "loop", "conv", "select")

modules = {f: importlib.import_module(f".{f}", __name__) for f in FAMILIES}
__all__ = [name for m in modules.values() for name in m.__all__]
globals().update({name: getattr(m, name) for m in modules.values() for name in m.__all__})


def samples(device, dtype) -> dict:
    """Every family's sample table merged: {op: {case name: {argument: value}}}."""
    out = {}
    for m in modules.values():
        out.update(m.samples(device, dtype))
    return out


def bad_samples() -> dict:
    """Every family's bad-input cases merged: {op: [(case name, mutation, argument named)]}."""
    out = {}
    for m in modules.values():
        out.update(m.bad_samples())
    return out
