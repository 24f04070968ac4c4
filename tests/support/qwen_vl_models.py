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
    depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1], out_hidden_size=64,
)  # fmt: skip
QWEN2_VISION = dict(  # Qwen2-VL's names: embed_dim the tower's width, hidden_size the language model's
    depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2,
)  # fmt: skip
IMAGE_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 16 * 16 * 4, "max_pixels": 64 * 80, "do_convert_rgb": True,
}  # fmt: skip


def save_qwen_vl(path: str, model_type: str = "qwen2_5_vl", **vision_settings):
    """The folder at `path` ("qwen2_5_vl" or "qwen2_vl"; `vision_settings` replacing VISION's);
    returns (path, the transformers model, its tokenizer)."""
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
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, {**VISION, **vision_settings}),
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


def reference(folder, num_tokens: int, text: str, images: list, image_config: dict = IMAGE_CONFIG) -> list[int]:
    """transformers' greedy continuation of `text`, each `<|image_pad|>` expanded to its image's pads
    (the image processor's settings: `image_config`)."""
    from transformers import Qwen2VLImageProcessorPil

    _, model, tok = folder
    inputs = {}
    if images:
        processed = Qwen2VLImageProcessorPil(**{k: v for k, v in image_config.items() if k != "image_processor_type"})(
            images, return_tensors="np"
        )
        grids = torch.tensor(np.asarray(processed["image_grid_thw"]))
        inputs["pixel_values"] = torch.tensor(np.asarray(processed["pixel_values"]))
        inputs["image_grid_thw"] = grids
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // image_config["merge_size"] ** 2 for g in grids]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tok.encode(text).ids])
    image_token = model.config.image_token_id
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int())
    out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def write_text_gguf(path: str, folder) -> None:
    """The folder's language model as llama.cpp's converter writes it: `qwen2vl` (Qwen2-VL,
    Qwen2.5-VL) or `qwen3vl` (with n_deepstack_layers), the M-RoPE split as rope.dimension_sections."""
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from tests.support.tiny_models import write_gguf

    _, model, tok = folder
    text_config = model.config.text_config.to_dict()
    kind = model.config.model_type
    qwen3 = kind in ("qwen3_vl", "qwen3_vl_moe")
    config_class, model_class = {
        "qwen3_vl": (Qwen3Config, Qwen3ForCausalLM), "qwen3_vl_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }.get(kind, (Qwen2Config, Qwen2ForCausalLM))  # fmt: skip
    # tied where the model's head is its embedding (Qwen3-VL-MoE's text_config says tied, the model is not)
    tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    settings = {k: v for k, v in text_config.items() if k != "model_type"}
    text = model_class(config_class(**{**settings, "tie_word_embeddings": tied})).eval()
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    section = list(model.config.text_config.rope_parameters["mrope_section"])
    metadata = {"rope.dimension_sections": section + [0]}
    if qwen3:
        metadata["n_deepstack_layers"] = len(model.config.vision_config.deepstack_visual_indexes)
    arch = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}.get(kind, "qwen2vl")
    write_gguf(path, arch, text, tok, metadata=metadata)


def write_mmproj(path: str, folder, image_config: dict) -> None:
    """The folder's vision tower as llama.cpp's converter writes it (`--mmproj`, f32): projector
    qwen2vl_merger, qwen2.5vl_merger or qwen3vl_merger. Checked against the 0.3.36 sdist's
    convert_hf_to_gguf.py on these tiny models (with depth 3: the converter maps merger.mlp.2 only
    below its block count): the same tensors, bytes and metadata apart from general.name and
    general.size_label."""
    import gguf
    import numpy as np

    _, model, _ = folder
    config, vision = model.config, model.config.vision_config
    kind = {"qwen2_vl": "qwen2vl_merger", "qwen2_5_vl": "qwen2.5vl_merger", "qwen3_vl": "qwen3vl_merger",
            "qwen3_vl_moe": "qwen3vl_merger"}[config.model_type]  # fmt: skip
    qwen3, width = kind == "qwen3vl_merger", getattr(vision, "embed_dim", None) or vision.hidden_size
    w = gguf.GGUFWriter(path, "clip")
    w.add_string("general.type", "mmproj")
    w.add_uint32("general.file_type", 0)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", config.text_config.hidden_size)
    image_size = int(vision.num_position_embeddings**0.5 * vision.patch_size) if qwen3 else 560
    ff = int(width * vision.mlp_ratio) if kind == "qwen2vl_merger" else vision.intermediate_size
    for key, value in (
        ("image_size", image_size), ("patch_size", vision.patch_size), ("embedding_length", width),
        ("feed_forward_length", ff), ("block_count", vision.depth), ("attention.head_count", vision.num_heads),
    ):  # fmt: skip
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_array("clip.vision.image_mean", image_config.get("image_mean", CLIP_MEAN))
    w.add_array("clip.vision.image_std", image_config.get("image_std", CLIP_STD))
    w.add_string("clip.projector_type", kind)
    if kind == "qwen2.5vl_merger":
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", vision.fullatt_block_indexes[0] + 1)
    if qwen3:
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if qwen3:
        flags = [i in vision.deepstack_visual_indexes for i in range(vision.depth)]
        w.add_array("clip.vision.is_deepstack_layers", flags)
    w.add_uint32("general.quantization_version", 2)
    block = {
        "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "mlp.linear_fc1": "ffn_up",
        "mlp.linear_fc2": "ffn_down", "attn.qkv": "attn_qkv",
    }  # fmt: skip
    merger = {"ln_q": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2", "norm": "v.post_ln", "linear_fc1": "mm.0",
              "linear_fc2": "mm.2"}  # fmt: skip
    deepstack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    for name, t in model.model.visual.state_dict().items():
        data = t.detach().float().numpy().astype(np.float32)
        head, _, k = name.rpartition(".")
        part, _, module = head.partition(".")
        if name == "patch_embed.proj.weight":
            w.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
            w.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
        elif name == "patch_embed.proj.bias":
            w.add_tensor("v.patch_embd.bias", data)
        elif name == "pos_embed.weight":
            w.add_tensor("v.position_embd.weight", data)
        elif part == "blocks":
            i, _, module = module.partition(".")
            if module == "attn.qkv" and not qwen3:
                for x, piece in zip("qkv", np.split(data, 3)):
                    w.add_tensor(f"v.blk.{i}.attn_{x}.{k}", np.ascontiguousarray(piece))
            else:
                w.add_tensor(f"v.blk.{i}.{block[module]}.{k}", data)
        elif part == "merger":
            w.add_tensor(f"{merger[module]}.{k}", data)
        else:  # deepstack_merger_list.K.*
            j, _, module = module.partition(".")
            w.add_tensor(f"v.deepstack.{vision.deepstack_visual_indexes[int(j)]}.{deepstack[module]}.{k}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
