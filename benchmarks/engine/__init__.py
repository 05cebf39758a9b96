"""Benchmarks of the engine and the model: speed against HF, the kernels, the weight modes and
their quality, speculative decoding, and the engine beside llama.cpp and vLLM."""
