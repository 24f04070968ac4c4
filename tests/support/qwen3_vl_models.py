"""A tiny random Qwen3-VL, as an HF folder: its tokenizer with Qwen's vision tokens, its image
processor's config (small pixel bounds, Qwen3-VL's 0.5 mean and std), and transformers' greedy
continuation as the reference (the same way as qwen_vl_models.py: `Qwen2VLImageProcessorPil`, the
pads written here).

Made so that the test can fail: q and k scaled up and a rotary theta of 100 (most frequencies
turn within an image: sectioned instead of interleaved M-RoPE changes the tokens), the DeepStack
mergers' outputs large enough that leaving them out changes the tokens, and a learned position grid
(4 x 4) smaller than the images' patch grids (interpolated)."""

import json
import os

import numpy as np
import torch

from tests.support.tiny_models import tiny_tokenizer

# 8 px patches merged 2 x 2: a token per 16 x 16 px; DeepStack from the first two of three blocks
VISION = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
)  # fmt: skip
IMAGE_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 16 * 16 * 4, "max_pixels": 64 * 80, "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip


def save_qwen3_vl(path: str, moe: bool = False, **vision_settings):
    """The folder at `path` (Qwen3-VL, or Qwen3-VL-MoE where `moe`; `vision_settings` replacing
    VISION's); returns (path, the transformers model, its tokenizer)."""
    from tokenizers import AddedToken
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in IMAGE_SPECIALS])
    ids = {s: tok.token_to_id(s) for s in IMAGE_SPECIALS}
    eos = tok.token_to_id("<|endoftext|>")
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=tok.get_vocab_size(), max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True,
        },
        bos_token_id=None, eos_token_id=eos,
    )  # fmt: skip
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    config_class, model_class = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    config = config_class(
        vision_config={**VISION, **vision_settings}, text_config=text, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # every weight random (transformers starts norms and biases at 1 or 0)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "visual" in name else 0.1))
            if "norm" in name and "weight" in name:
                p.add_(1.0)
            if "q_proj" in name or "k_proj" in name:  # sharp attention: positions change the tokens
                p.mul_(3.0)
            if "deepstack_merger_list" in name and "linear_fc2" in name:  # DeepStack changes the tokens
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(IMAGE_CONFIG, f)
    return path, model, tok


def processed(images: list, image_config: dict = IMAGE_CONFIG) -> dict:
    """transformers' processor outputs for `images`: pixel_values and image_grid_thw, as tensors."""
    from transformers import Qwen2VLImageProcessorPil

    settings = {k: v for k, v in image_config.items() if k != "image_processor_type"}
    out = Qwen2VLImageProcessorPil(**settings)(images, return_tensors="np")
    return {k: torch.tensor(np.asarray(out[k])) for k in ("pixel_values", "image_grid_thw")}


def reference(folder, num_tokens: int, text: str, images: list, image_config: dict = IMAGE_CONFIG) -> list[int]:
    """transformers' greedy continuation of `text`, each `<|image_pad|>` expanded to its image's pads
    (the image processor's settings: `image_config`)."""
    _, model, tok = folder
    inputs = {}
    if images:
        inputs = processed(images, image_config)
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in inputs["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tok.encode(text).ids])
    image_token = model.config.image_token_id
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int())
    out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()
