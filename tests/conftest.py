"""Shared test plumbing: the ``gpu`` marker auto-skip, seeding, and ``poison``.

* ``@pytest.mark.gpu`` tests are skipped with the reason "needs a CUDA GPU" when
  ``torch.cuda.is_available()`` is False.
* Every test starts from a seed derived from its node id (stable across runs and independent of
  test order); ``DFLASH_TEST_SEED=<int>`` shifts all of them to explore other inputs. The
  ``seed`` fixture returns the test's seed; ``seed_all(n)`` reseeds by hand.
* ``poison(t)`` fills a floating tensor with NaN (in place) so an element a kernel forgets to
  write shows up as a mismatch.
* ``run_interpreted(script, *args)`` runs a Python snippet from the repository root with
  TRITON_INTERPRET=1 (it must be set before triton is imported, hence a subprocess) and asserts
  it exits cleanly and prints "interp-ok".
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

_GPU_SKIP_REASON = "needs a CUDA GPU"


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so the marker is known when run from elsewhere.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason on CPU)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def seed_all(seed: int) -> int:
    """Seed python's and torch's generators (CPU and, if present, CUDA)."""
    seed = int(seed) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def seed_for(name: str) -> int:
    """A stable seed for a test id (crc32, not hash(): that one is salted per process)."""
    base = int(os.environ.get("DFLASH_TEST_SEED", "0"))
    return (zlib.crc32(name.encode()) + base) % (2**31)


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seeds every test from its node id; request the fixture to read the seed."""
    return seed_all(seed_for(request.node.nodeid))


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating-point tensor with NaN in place and return it."""
    if not t.is_floating_point():
        raise TypeError(f"poison: needs a floating-point tensor, got {t.dtype}")
    return t.fill_(float("nan"))


def run_interpreted(script: str, *args: str, timeout: int = 900) -> None:
    """Run ``script`` (python -c, with ``args``) from the repository root under the Triton
    interpreter on CPU; it must exit 0 and print "interp-ok"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "interp-ok" in proc.stdout, \
        proc.stdout + proc.stderr[-5000:]
