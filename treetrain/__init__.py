"""treetrain: reinforcement learning for LLM agents on Kubernetes, with tree packing.

Importing ``treetrain`` stays light (no torch): the operator image imports
``treetrain.alloc`` with only the ``operator`` extra installed.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treetrain.logprob import tree_logprobs

__all__ = ["__version__", "tree_logprobs"]


def __getattr__(name: str) -> Any:
    # `tree_logprobs` needs torch: import it on first use, never at `import treetrain`.
    if name == "tree_logprobs":
        from treetrain.logprob import tree_logprobs

        return tree_logprobs
    raise AttributeError(f"module 'treetrain' has no attribute {name!r}")
