"""Regenerate tests/data/lora/: a random PEFT LoRA adapter for the tiny Llama of tests/support/tiny_models.py
and the same adapter converted by llama.cpp's own convert_lora_to_gguf.py.

    python -m tests.support.make_lora_files

The adapter targets q, k, v, o and down (q and k: the rows llama.cpp permutes for its RoPE layout).
The converter comes from the llama-cpp-python sdist that bench/peer_compare.py's builder unpacks
(version there), run with its own gguf-py; it reads only the base model's config.json. The files
are committed (a few KB), so the test suite needs neither the sdist nor the converter.
"""

import os
import subprocess
import sys
import tempfile

from tests.support import paths

FOLDER = os.path.join(paths.DATA, "lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


def main() -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, paths.BENCH)
    from peer_compare import CACHE, LLAMA_CPP_PYTHON, find_or_build_llama_tool

    from tests.support.tiny_models import save_hf_model

    src = os.path.join(CACHE, f"llama_cpp_python-{LLAMA_CPP_PYTHON}", "vendor", "llama.cpp")
    if not os.path.isdir(src):
        find_or_build_llama_tool("llama-quantize")  # downloads and unpacks the sdist (and builds a small tool)
    with tempfile.TemporaryDirectory() as tmp:
        base = save_hf_model(os.path.join(tmp, "base"), "llama", seed=3)
        torch.manual_seed(11)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        peft_dir = os.path.join(FOLDER, "peft")
        model.save_pretrained(peft_dir)
        readme = os.path.join(peft_dir, "README.md")  # peft's model card template: not part of the adapter
        if os.path.exists(readme):
            os.remove(readme)
        out = os.path.join(FOLDER, "adapter.gguf")
        env = {**os.environ, "PYTHONPATH": os.path.join(src, "gguf-py")}
        cmd = [
            sys.executable,
            os.path.join(src, "convert_lora_to_gguf.py"),
            "--base",
            os.path.join(tmp, "base"),
            "--outtype",
            "f32",
            "--outfile",
            out,
            peft_dir,
        ]
        subprocess.run(cmd, check=True, env=env)
    print(f"wrote {peft_dir} and {out}")


if __name__ == "__main__":
    main()
