"""The name the layout had before the layout protocol (:mod:`treetrain.engines.layout`), for the
trainer's importers; new code imports :class:`~treetrain.engines.layout.Layout`."""

from treetrain.engines.layout import Layout as ParallelLayout

__all__ = ["ParallelLayout"]
