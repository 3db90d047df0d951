"""DFlash drafter models: configuration and weights (the drafter module lives in ``drafter``)."""
from .config import DFlashConfig, default_target_layer_ids, validate_fc
from .weights import (
    check_drafter_state, expected_shapes, load_state, save_speculators, save_zlab, stack_kv,
    zlab_to_speculators,
)

__all__ = ["DFlashConfig", "default_target_layer_ids", "validate_fc", "check_drafter_state",
           "expected_shapes", "load_state", "save_speculators", "save_zlab", "stack_kv",
           "zlab_to_speculators"]
