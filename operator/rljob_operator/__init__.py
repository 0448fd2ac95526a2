"""rljob_operator: the kopf operator that runs RLJob custom resources.

Imports only the ``operator`` extra (kopf, kubernetes, pydantic) and ``treetrain.alloc``:
never torch.
"""
