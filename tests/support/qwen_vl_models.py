"""A tiny random Qwen2.5-VL (or Qwen2-VL), as an HF folder: its tokenizer with Qwen's vision tokens, its image
processor's config (small pixel bounds), and transformers' greedy continuation as the reference.

The reference is built without treadle's front end and without transformers' Qwen2.5-VL processor
(whose video processor needs torchvision): `Qwen2VLImageProcessorPil` makes the pixel values and
grids, and the prompt's pads are written here (one `<|image_pad|>` per merge window)."""

import json
import os

import numpy as np
import torch

from tests.support.tiny_models import tiny_tokenizer

# 8 px patches merged 2 x 2: a token per 16 x 16 px; attention windows of 32 px (2 x 2 tokens)
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1], out_hidden_size=64,
)  # fmt: skip
QWEN2_VISION = dict(  # Qwen2-VL's names: embed_dim the tower's width, hidden_size the language model's
    depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2,
)  # fmt: skip
IMAGE_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 16 * 16 * 4, "max_pixels": 64 * 80, "do_convert_rgb": True,
}  # fmt: skip


def save_qwen_vl(path: str, model_type: str = "qwen2_5_vl"):
    """The folder at `path` ("qwen2_5_vl" or "qwen2_vl"); returns (path, the transformers model, its tokenizer)."""
    from tokenizers import AddedToken
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in IMAGE_SPECIALS])
    ids = {s: tok.token_to_id(s) for s in IMAGE_SPECIALS}
    eos = tok.token_to_id("<|endoftext|>")
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None, eos_token_id=eos,
    )  # fmt: skip
    config_class, model_class, vision = {
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, VISION),
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, QWEN2_VISION),
    }[model_type]
    config = config_class(
        vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # every weight random (transformers starts norms and biases at 1 or 0)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "visual" in name else 0.1))
            if "visual" not in name and "norm" in name:
                p.add_(1.0)
            elif "q_proj" in name or "k_proj" in name:  # sharp attention: positions change the tokens
                p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(IMAGE_CONFIG, f)
    return path, model, tok


def reference(folder, num_tokens: int, text: str, images: list) -> list[int]:
    """transformers' greedy continuation of `text`, each `<|image_pad|>` expanded to its image's pads."""
    from transformers import Qwen2VLImageProcessorPil

    _, model, tok = folder
    inputs = {}
    if images:
        processed = Qwen2VLImageProcessorPil(**{k: v for k, v in IMAGE_CONFIG.items() if k != "image_processor_type"})(
            images, return_tensors="np"
        )
        grids = torch.tensor(np.asarray(processed["image_grid_thw"]))
        inputs["pixel_values"] = torch.tensor(np.asarray(processed["pixel_values"]))
        inputs["image_grid_thw"] = grids
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in grids]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tok.encode(text).ids])
    image_token = model.config.image_token_id
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int())
    out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()
