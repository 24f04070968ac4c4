"""treadle's own C kernels, built on first use with the system's C compiler and cached.

`paged.py` / `paged_attention.c`: attention for bfloat16 KV caches with a fixed order of every sum
per query token.

`quant.c` / `quant.py`: products and row lookups of weights held as GGUF's quantized blocks (see
quant.c's header for what they compute); `quant_lib.py`: its library and instruction-set choice.

`rowops.c` / `rowops.py`: the rotary embedding and RMSNorm of bfloat16 rows, one call each.
`decoder.c` / `decoder.py`: a decoder layer's steps in one call.
`build.Library` loads each on first use, once.

The package itself imports no torch (nor does `build` or `quant_lib`): an engine core loads
quant.c's library and repacks a GGUF file's tensors while torch is still importing (gguf_prefetch).
"""
