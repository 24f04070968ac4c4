"""Regenerate tests/data/quant/: a tiny random Llama model quantized by llama.cpp's own quantizer.

    python -m tests.support.make_quant_files

The model (1 layer, width 256, so that every K-quant applies; vocabulary 261, so that rows do not
fill whole groups of 16) is written as a float32 GGUF, then `llama-quantize --pure` makes one file
per type: every matrix in that type, embedding and output included. llama-quantize is built by
bench/peer_compare.py's builder from the llama-cpp-python sdist (version there). The files are
committed (a few hundred KB each), so the test suite needs no quantizer.
"""

import os
import subprocess
import sys
import tempfile

import torch

from tests.support import paths

FOLDER = os.path.join(paths.DATA, "quant")
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, head_dim=64, initializer_range=0.08)


def tiny_model():
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_models import hf_config, tiny_tokenizer

    tok = tiny_tokenizer()
    config = hf_config("llama", tok.get_vocab_size())
    for key, value in SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(7)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tok


def main() -> None:
    sys.path.insert(0, paths.BENCH)
    from peer_compare import find_or_build_llama_tool

    from tests.support.tiny_models import write_gguf

    quantize = find_or_build_llama_tool("llama-quantize")
    model, tok = tiny_model()
    os.makedirs(FOLDER, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        write_gguf(f32, "llama", model, tok)
        for kind in TYPES:
            out = os.path.join(FOLDER, f"{kind}.gguf")
            env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(quantize))
            subprocess.run([quantize, "--pure", f32, out, kind, "1"], check=True, capture_output=True, env=env)
            print(out, os.path.getsize(out))


if __name__ == "__main__":
    main()
