"""Model families: one module per family, the `CausalLM` interface they subclass, and the registry.

A family imports layers/, kernels/, the interface, the model config and the GGUF name table
(loading/gguf_names.py); never execution/ or the rest of loading/.
"""
