"""The models on ``torch.ops.dflash``: the DFlash drafter (``drafter``; its configuration and
weights exported here) and the target (``target``), over one decoder layer (``layer``), one HF
config parser (``hf_config``), the paged KV cache (``cache``) and the linear layers
(``linear``)."""
from .config import DFlashConfig, default_target_layer_ids, validate_fc
from .weights import (
    check_drafter_state, expected_shapes, load_state, save_speculators, save_target, save_zlab,
    stack_kv, zlab_to_speculators,
)

__all__ = ["DFlashConfig", "default_target_layer_ids", "validate_fc", "check_drafter_state",
           "expected_shapes", "load_state", "save_speculators", "save_target", "save_zlab",
           "stack_kv", "zlab_to_speculators"]
