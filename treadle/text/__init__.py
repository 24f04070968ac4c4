"""Text: the tokenizer, chat templates and incremental detokenization.

The front end's package: importable without torch (the HTTP process never loads it). Of model/ it
imports only the torch-free GGUF reader and `ModelLoadError`; nothing of engine/.
"""
