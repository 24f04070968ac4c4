"""Tiny random SmolVLM and Idefics3 folders: a Llama text model that sees through SigLIP, its
tokenizer with the image tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`, the
`<row_i_col_j>` tags), a chat template placing images, its image processor's config; and
transformers' greedy continuation of a prompt with images, the reference."""

import json
import os

import torch
from PIL import Image

from tests.support.tiny_models import tiny_tokenizer

IMAGE_SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
CHAT_TEMPLATE = (  # SmolVLM's, simplified (no videos)
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}"
    "{% if m['content'] is string %}{{ ': ' + m['content'] }}{% else %}: {% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def save_idefics3_vlm(
    path: str,
    model_type: str = "smolvlm",
    patch: int = 8,
    patches_per_side: int = 6,
    scale_factor: int = 2,
    do_image_splitting: bool = True,
) -> dict:
    """The folder at `path`: tiles of patches_per_side x patch px, `scale_factor`² patches to a token,
    images resized to two tiles' width first. Returns what `reference` needs: the path, the
    transformers model, its tokenizer, the image processor's config and the tokens per tile."""
    from tokenizers import AddedToken
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in IMAGE_SPECIALS])
    tile = patch * patches_per_side
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=tile,
        patch_size=patch, layer_norm_eps=1e-5,
    )  # fmt: skip
    text = dict(
        model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=1000.0, pad_token_id=0, bos_token_id=tok.token_to_id("<|im_start|>"),
        eos_token_id=tok.token_to_id("<end_of_utterance>"),
    )  # fmt: skip
    config_class, model_class = {
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration),
    }[model_type]
    config = config_class(
        vision_config=vision, text_config=text, scale_factor=scale_factor, image_token_id=tok.token_to_id("<image>")
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    # every weight random (transformers starts norms and biases at 1 or 0); the text model's large
    # enough that the greedy tokens follow the image's embeddings closely (at 0.1, tiles with their
    # patches regrouped wrongly gave the same tokens)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "vision" in name or "connector" in name else 0.5))
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "chat_template": CHAT_TEMPLATE}, f)
    processor = "SmolVLM" if model_type == "smolvlm" else "Idefics3"
    image_config = {
        "image_processor_type": f"{processor}ImageProcessor", "do_resize": True, "size": {"longest_edge": 2 * tile},
        "max_image_size": {"longest_edge": tile}, "do_image_splitting": do_image_splitting, "resample": 1,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "do_pad": True, "do_convert_rgb": True,
    }  # fmt: skip
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(image_config, f)
    tokens_per_tile = (patches_per_side // scale_factor) ** 2
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": f"{processor}Processor", "image_seq_len": tokens_per_tile}, f)
    return dict(path=path, model=model, tokenizer=tok, image_config=image_config, tokens_per_tile=tokens_per_tile)


def transformers_pixels(folder: dict, images: list[Image.Image]) -> dict:
    """transformers' own PIL image processor's output for one prompt's images: pixel_values
    [1, tiles, 3, H, W], pixel_attention_mask, and each image's rows and cols of tiles."""
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

    config = dict(folder["image_config"])
    processor_class = {
        "SmolVLMImageProcessor": SmolVLMImageProcessorPil,
        "Idefics3ImageProcessor": Idefics3ImageProcessorPil,
    }[config.pop("image_processor_type")]
    return processor_class(**config)([images], return_tensors="pt", return_row_col_info=True)


def reference(folder: dict, num_tokens: int, text: str, images: list[Image.Image]) -> list[int]:
    """transformers' greedy continuation of `text`, each `<image>` expanded as its processor does
    (`get_image_prompt_string` of the image's rows and cols of tiles)."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    model, tok = folder["model"], folder["tokenizer"]
    inputs, expanded = {}, text
    if images:
        processed = transformers_pixels(folder, images)
        pieces = text.split("<image>")
        assert len(pieces) == len(images) + 1
        expanded = pieces[0]
        for rows, cols, piece in zip(processed["rows"][0], processed["cols"][0], pieces[1:]):
            expanded += get_image_prompt_string(
                rows, cols, folder["tokens_per_tile"], "<fake_token_around_image>", "<image>", "<global-img>"
            )
            expanded += piece
        inputs = {k: processed[k] for k in ("pixel_values", "pixel_attention_mask")}
    ids = torch.tensor([tok.encode(expanded).ids])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, max_new_tokens=num_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def write_mmproj(path: str, folder: dict) -> None:
    """The folder's encoder and connector as llama.cpp's converter writes them (`--mmproj`, f32;
    checked against the 0.3.36 sdist's convert_hf_to_gguf.py: the same tensors, bytes and
    metadata apart from general.name and general.size_label)."""
    import numpy as np

    from tests.support.vision_models import siglip_mmproj_writer

    model, image_config = folder["model"], folder["image_config"]
    config = model.config
    mean, std = image_config["image_mean"], image_config["image_std"]
    writer = siglip_mmproj_writer(path, model, mean, std, "idefics3")
    writer.add_uint32("general.file_type", 0)
    writer.add_uint32("clip.vision.projector.scale_factor", config.scale_factor)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.preproc_image_size", image_config["size"]["longest_edge"])
    writer.add_uint32("general.quantization_version", 2)
    layer_names = {
        "layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
    }  # fmt: skip
    global_names = {
        "embeddings.patch_embedding": "v.patch_embd",
        "embeddings.position_embedding": "v.position_embd",
        "post_layernorm": "v.post_ln",
    }
    tensors = {"mm.model.fc.weight": model.model.connector.modality_projection.proj.weight}
    for name, t in model.model.vision_model.state_dict().items():
        base, _, kind = name.rpartition(".")
        if base in global_names:
            tensors[f"{global_names[base]}.{kind}"] = t
        else:
            _, _, layer, rest = base.split(".", 3)  # encoder.layers.N.<module>
            tensors[f"v.blk.{layer}.{layer_names[rest]}.{kind}"] = t
    for name, t in tensors.items():
        writer.add_tensor(name, t.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
