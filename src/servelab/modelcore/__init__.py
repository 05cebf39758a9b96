"""The light model core: what a model is, with no torch (docs/design/overview.md, "Layers").

- ``catalogue``: model names -> weight locations (the default model, GGUF or HF directory).
- ``config``: the model's shape, from an HF ``config.json`` or a GGUF file's metadata.
- ``tokenizer``: the model's tokenizer and chat template.
- ``gguf_meta``: a GGUF file's key/value metadata and tensor names, without the ``gguf`` package.

``bench``, ``sim``, ``engine`` and the torch runtime (``servelab.model``) read it; it imports
nothing of servelab above ``vocab``.
"""
