"""The model layer: names -> weights, tokenizer and a torch executor (see docs/design/model.md).

Light entry points (no torch): ``registry.resolve_model``, ``tokenizer.Tokenizer``,
``config.ModelConfig``, ``export.export_hf``. Heavy ones: ``loader.load_model``,
``runner.TorchModelRunner``. This package imports none of them eagerly.
"""
