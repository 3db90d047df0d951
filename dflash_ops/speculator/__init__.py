"""The DFlash draft-and-verify loop (``loop``) and the built-in demo (``demo``)."""
from .loop import Stats, plain_greedy, speculative_generate

__all__ = ["Stats", "plain_greedy", "speculative_generate"]
