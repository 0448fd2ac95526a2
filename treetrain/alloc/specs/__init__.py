"""One description per engine (:class:`treetrain.alloc.spec.EngineSpec`), each in its own module;
:mod:`treetrain.alloc.registry` lists them."""
