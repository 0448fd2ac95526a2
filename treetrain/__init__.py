"""treetrain: reinforcement learning for LLM agents on Kubernetes, with tree packing.

Importing ``treetrain`` stays light (no torch): the operator image imports
``treetrain.alloc`` with only the ``operator`` extra installed.
"""

__version__ = "0.1.0"
