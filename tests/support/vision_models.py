"""A tiny random Gemma 3 that sees, as an HF folder: its tokenizer with Gemma's image tokens, a
chat template that places images, its image processor's config. Shared by the offline and the
server tests of image input."""

import json
import os

import numpy as np
import torch
from PIL import Image, ImageDraw

from tests.support.tiny_models import tiny_tokenizer

# the vision tower: 64 px images of 8 px patches (8 x 8), pooled 2 x 2 into 16 soft tokens
VISION = dict(
    model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, image_size=64, patch_size=8, layer_norm_eps=1e-5, vision_use_head=False,
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOKENS_PER_IMAGE = 16
IMAGE_SPECIALS = ["<bos>", "<eos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def soft_image() -> str:
    return "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"


def picture(seed: int, size=(40, 56)) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(img)
    draw.ellipse((5, 5, 30, 25), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return img


def weight_scale(name: str) -> float:
    """The random weights' spread: small in the tower (large image features would swamp the text),
    wide on the norms (Gemma's 1 + w), small elsewhere; chosen so that each picture changes the
    greedy continuation (at transformers' defaults the model says one token whatever it sees)."""
    if "vision" in name or "projector" in name:
        return 0.05
    return 1.0 if "norm" in name else 0.02


def save_gemma3_vlm(path: str):
    """The folder at `path`; returns (path, the transformers model, its tokenizer, the image processor's config)."""
    from tokenizers import AddedToken
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in IMAGE_SPECIALS])
    ids = {s: tok.token_to_id(s) for s in IMAGE_SPECIALS}
    vision = VISION
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, vocab_size=tok.get_vocab_size(), sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=0,
    )  # fmt: skip
    config = Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # every weight random (transformers starts norms and biases at 1 or 0)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * weight_scale(name))
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}, f)
    image_config = {
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": 64, "width": 64}, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "do_convert_rgb": True,
    }  # fmt: skip
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(image_config, f)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}, f)
    return path, model, tok, image_config


def reference(folder, num_tokens: int, text: str, images: list[Image.Image]) -> list[int]:
    """transformers' greedy continuation of `text` (each <start_of_image> expanded as Gemma3Processor does)."""
    from transformers import Gemma3ImageProcessorPil

    _, model, tok, image_config = folder
    expanded = text.replace("<start_of_image>", soft_image())
    ids = torch.tensor([tok.encode(expanded).ids])
    image_token = model.config.image_token_index
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": (ids == image_token).long()}
    if images:
        processor = Gemma3ImageProcessorPil(**image_config)
        inputs["pixel_values"] = torch.tensor(np.asarray(processor(images, return_tensors="np")["pixel_values"]))
    out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def siglip_mmproj_writer(path: str, model, mean: list, std: list, kind: str):
    """A GGUFWriter of llama.cpp's mmproj for `model`'s SigLIP tower (a transformers VLM), with the
    keys the converter writes for every such tower: the encoder's shape, the text model's width,
    the image mean and std, the projector `kind` and the layer norm's epsilon. The caller adds its
    projector's keys and the tensors, then writes the file."""
    import gguf

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", model.config.text_config.hidden_size)
    for key, value in (
        ("image_size", vision.image_size),
        ("patch_size", vision.patch_size),
        ("embedding_length", vision.hidden_size),
        ("feed_forward_length", vision.intermediate_size),
        ("block_count", vision.num_hidden_layers),
        ("attention.head_count", vision.num_attention_heads),
    ):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_array("clip.vision.image_mean", mean)
    writer.add_array("clip.vision.image_std", std)
    writer.add_string("clip.projector_type", kind)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    return writer
