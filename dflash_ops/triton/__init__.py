"""Triton kernels, one module per op family; each registers itself with the dispatcher.

Importing is skipped (the backend is then absent) when triton is not installed.
"""
import importlib.util
import logging

if importlib.util.find_spec("triton") is not None:
    from . import norm  # noqa: F401
    from . import rope  # noqa: F401
    from . import kv  # noqa: F401
    from . import context  # noqa: F401
    from . import attention  # noqa: F401
    from . import act  # noqa: F401
    AVAILABLE = True
else:  # pragma: no cover - triton ships with CUDA torch and in the test extras
    AVAILABLE = False
    logging.getLogger("dflash_ops").info("dflash_ops: triton not installed; no triton backend")
