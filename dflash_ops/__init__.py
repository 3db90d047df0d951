"""dflash_ops: kernels for DFlash speculative decoding, as ``torch.ops.dflash.*``.

Importing the package defines every op (schema, fake kernel, PyTorch reference), registers the
Triton kernels, and loads the CUDA extension (built, or JIT-compiled from csrc/) when a GPU is
present. See ``dflash_ops.dispatch`` for how a backend is chosen.
"""
__version__ = "0.1.0"

from . import dispatch  # noqa: E402
from .ops import (  # noqa: E402,F401
    block_attention, context_kv_, fused_add_rms_norm_, knorm_rope_, kv_proj, make_cos_sin_cache,
    qk_norm_rope_, rms_norm, rope_, silu_mul, store_kv_,
)
from . import triton as _triton_backend  # noqa: E402,F401  (registers the Triton kernels)
from . import _ext  # noqa: E402

_ext.load()
dispatch._init_from_env()
dispatch.note_cuda_extension_loaded()

use_backend = dispatch.use_backend
graph_backends = dispatch.graph_backends
set_backend = dispatch.set_backend
BackendUnavailableError = dispatch.BackendUnavailableError


def backend_for(op: str, device: str = "cuda") -> str:
    """The backend ``torch.ops.dflash.<op>`` runs with on ``device`` right now."""
    return dispatch.resolve(op, device)
