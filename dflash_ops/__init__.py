"""dflash_ops: kernels for DFlash speculative decoding, as ``torch.ops.dflash.*``.

Importing the package defines every op (schema, fake kernel, PyTorch reference), registers the
Triton kernels, and loads the CUDA extension (built, or JIT-compiled from csrc/) when a GPU is
present. See ``dflash_ops.dispatch`` for which kernel runs.
"""
__version__ = "0.1.0"

from . import dispatch  # noqa: E402
from .ops import *  # noqa: E402,F401,F403  (every family's wrappers: rms_norm, ..., greedy_commit)
from . import triton as _triton_backend  # noqa: E402,F401  (registers the Triton kernels)
from . import _ext  # noqa: E402

_ext.load()
dispatch._init_from_env()
dispatch.note_cuda_extension_loaded()

use_backend = dispatch.use_backend
set_backend = dispatch.set_backend
BackendUnavailableError = dispatch.BackendUnavailableError


def backend_for(op: str, device: str = "cuda", graph: bool = False) -> str:
    """The backend ``torch.ops.dflash.<op>`` runs with on ``device`` right now: in an eager
    call, or (``graph=True``) in one recorded into a CUDA graph."""
    return dispatch.resolve(op, device, graph)
