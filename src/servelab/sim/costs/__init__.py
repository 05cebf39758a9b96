"""Cost models: what one engine step costs, from a roofline, a profile or measured runs.

``work`` reduces a step to the sums every model needs; ``roofline`` prices them from FLOPs and
bytes on a ``hardware`` entry with a model's ``model_shapes`` and ``dtypes``; ``profiled``
interpolates measured steps; ``noise`` and ``drift`` hold how far real steps stray from a
model; ``executor`` puts any of them behind the engine's ``Executor`` protocol.
"""
