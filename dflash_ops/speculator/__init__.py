"""The DFlash draft-and-verify loop (``loop``), its iteration (``step``) over the static-buffer
steps (``draft_step``, ``verify_step``), and the built-in demo (``demo``)."""
from .loop import Stats, exact_mode, plain_greedy, speculative_generate

__all__ = ["Stats", "exact_mode", "plain_greedy", "speculative_generate"]
