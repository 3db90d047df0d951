"""Triton kernels, one module per op family (named as in ``dflash_ops/ops``); each registers its
kernels with the dispatcher on import.

Importing is skipped (the backend is then absent) when triton is not installed.
"""
import importlib
import importlib.util
import logging

from ..ops import FAMILIES

if importlib.util.find_spec("triton") is not None:
    for _family in FAMILIES:
        importlib.import_module(f".{_family}", __name__)
    AVAILABLE = True
else:  # pragma: no cover - triton ships with CUDA torch and in the test extras
    AVAILABLE = False
    logging.getLogger("dflash_ops").info("dflash_ops: triton not installed; no triton backend")
