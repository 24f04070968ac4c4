"""Loading: a model file (GGUF or Hugging Face folder) -> ModelConfig, weights, tokenizer.

The GGUF reader and name table, the GGUF and HF loaders, the served file's prefetch, deferred
weights, --quantization's quantizer and the embedded default model. A family is reached only
through the registry and the `CausalLM` interface.
"""
