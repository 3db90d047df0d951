"""Op families: each module defines its ops' schemas, checks, references and fake kernels."""
from .norm import rms_norm, fused_add_rms_norm_, rms_norm_ref  # noqa: F401
from .rope import rope_, qk_norm_rope_, knorm_rope_, make_cos_sin_cache, rope_values  # noqa: F401
from .kv import store_kv_, kv_proj, context_kv_, store_kv_ref, kv_proj_ref, context_kv_ref  # noqa: F401
from .attention import block_attention, block_attention_ref  # noqa: F401
from .act import silu_mul, silu_mul_ref  # noqa: F401
