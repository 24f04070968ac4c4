"""The decoder's building blocks, shared by the families: attention, norms, rotary, linear, MoE, Mamba-2, LoRA."""
