"""Gemma 3's image encoder (SigLIP and the projector) against transformers' `get_image_features` on a
tiny random Gemma3ForConditionalGeneration saved as safetensors: 32 px images of 8 px patches
(4 x 4 patches), pooled 2 x 2 into 4 soft tokens of the text model's width.

The same model as llama.cpp's mmproj GGUF file is written here as its converter writes it
(convert_hf_to_gguf.py --mmproj --outtype f32 of llama-cpp-python 0.3.36's vendored llama.cpp,
`conversion/gemma.py`, Gemma3VisionModel): `v.*` and `mm.*` names, the projector's norm as 1 + w,
its projection in float16, `projector.scale_factor` written where the pool is not 4 x 4.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treadle.model.config import ModelLoadError
from treadle.model.families.gemma3_vision import Gemma3Vision
from treadle.model.loading.gguf_file import open_gguf

VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    layer_norm_eps=1e-5,
    vision_use_head=False,
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=300,
)
TOKEN_IDS = dict(image_token_index=299, boi_token_index=297, eoi_token_index=298)


def hf_model(config_dict: dict, seed: int = 0):
    """A Gemma3ForConditionalGeneration whose vision weights are all random: transformers starts
    biases at 0 and norms at 1 or 0, which would hide a bias or norm read from the wrong place."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(Gemma3Config(**config_dict)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layer_norm" in name or "layernorm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gemma3_vision"))
    model = hf_model(dict(vision_config=VISION, text_config=TEXT, mm_tokens_per_image=4, **TOKEN_IDS))
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def read(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return config, tensors


def load(config: dict, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> Gemma3Vision:
    return Gemma3Vision.from_hf(config, tensors.__getitem__, tensors.keys(), dtype)


def pixels(n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=generator) * 2 - 1  # the processor's range


@torch.inference_mode()
def hf_soft_tokens(model, pixel_values: torch.Tensor) -> torch.Tensor:
    return model.get_image_features(pixel_values).pooler_output  # the projector's output


@pytest.mark.parametrize("images", [1, 2])
def test_soft_tokens_match_transformers_in_float32(checkpoint, images):
    folder, model = checkpoint
    vision = load(*read(folder))
    x = pixels(images)
    ours, theirs = vision.encode(x), hf_soft_tokens(model, x)
    assert ours.dtype == torch.float32 and ours.shape == (images, 4, TEXT["hidden_size"]) == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert theirs.abs().max() > 0.5  # not a vacuous comparison of near-zero values


def test_images_in_a_batch_are_encoded_independently(checkpoint):
    vision = load(*read(checkpoint[0]))
    x = pixels(3)
    batch = vision.encode(x)
    for i in range(3):
        torch.testing.assert_close(vision.encode(x[i : i + 1])[0], batch[i], atol=1e-6, rtol=1e-6)


def test_soft_tokens_match_transformers_in_bfloat16(checkpoint):
    folder, model = checkpoint
    vision = load(*read(folder), dtype=torch.bfloat16)
    x = pixels(2)
    ours = vision.encode(x)
    theirs = hf_soft_tokens(model.to(torch.bfloat16), x)
    model.to(torch.float32)
    reference = hf_soft_tokens(model, x)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits: a few units in the last place of the outputs (magnitude ~1-5)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=0.06, rtol=0.02)
    # and as far from the float32 result as transformers' own bfloat16 run is
    ours_error = (ours.float() - reference).abs().max()
    theirs_error = (theirs.float() - reference).abs().max()
    assert ours_error <= 2 * theirs_error + 1e-3, (ours_error, theirs_error)


@pytest.mark.parametrize(
    "tower, projector",
    [
        ("vision_tower.vision_model.", "multi_modal_projector."),  # Google's files, transformers 4
        ("model.vision_tower.vision_model.", "model.multi_modal_projector."),  # transformers 4.5x
        ("model.vision_tower.", "model.multi_modal_projector."),  # transformers 5 in memory
    ],
)
def test_every_name_layout_loads_the_same_encoder(checkpoint, tower, projector):
    folder, _ = checkpoint
    config, tensors = read(folder)
    assert any(n.startswith("vision_tower.embeddings.") for n in tensors)  # transformers 5's save_pretrained
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("vision_tower."):
            name = tower + name.removeprefix("vision_tower.")
        elif name.startswith("multi_modal_projector."):
            name = projector + name.removeprefix("multi_modal_projector.")
        renamed[name] = t
    other = os.path.join(folder, "renamed.safetensors")
    save_file(renamed, other)
    with safe_open(other, "pt") as f:
        vision = Gemma3Vision.from_hf(config, f.get_tensor, f.keys(), torch.float32)
    x = pixels(2)
    assert torch.equal(vision.encode(x), load(config, tensors).encode(x))


def test_the_attributes_come_from_the_config(checkpoint):
    config, tensors = read(checkpoint[0])
    vision = load(config, tensors)
    assert (vision.tokens_per_image, vision.image_size, vision.hidden_size) == (4, 32, TEXT["hidden_size"])
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (299, 297, 298)


def test_missing_keys_take_transformers_defaults(checkpoint):
    from transformers import Gemma3Config

    config, tensors = read(checkpoint[0])
    for key in ("image_token_index", "boi_token_index", "eoi_token_index"):
        del config[key]
    for key in ("layer_norm_eps", "hidden_act", "num_channels"):
        del config["vision_config"][key]
    hf = Gemma3Config(**config)
    vision = load(config, tensors)
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (
        hf.image_token_id,
        hf.boi_token_id,
        hf.eoi_token_id,
    )
    tower = vision.tower.config
    assert (tower.layer_norm_eps, tower.hidden_act, tower.num_channels) == (
        hf.vision_config.layer_norm_eps,
        hf.vision_config.hidden_act,
        hf.vision_config.num_channels,
    )


def test_the_image_encoder_owns_the_vision_and_projector_tensors_only(checkpoint):
    _, tensors = read(checkpoint[0])
    vision = {n for n in tensors if Gemma3Vision.is_vision_tensor(n)}
    assert vision and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in vision)
    assert all(n.startswith(("language_model.", "lm_head.")) for n in set(tensors) - vision)
    assert Gemma3Vision.is_vision_tensor("model.vision_tower.vision_model.post_layernorm.weight")
    assert not Gemma3Vision.is_vision_tensor("model.language_model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("tokens", [8, 9])  # not a square; a square whose side (3) does not divide 4 patches
def test_a_token_count_the_patch_grid_cannot_pool_to_is_refused(checkpoint, tokens):
    config, tensors = read(checkpoint[0])
    config["mm_tokens_per_image"] = tokens
    with pytest.raises(ModelLoadError, match="mm_tokens_per_image"):
        load(config, tensors)


def test_a_weight_of_the_wrong_shape_is_refused(checkpoint):
    config, tensors = read(checkpoint[0])
    tensors["vision_tower.encoder.layers.1.mlp.fc1.weight"] = torch.zeros(65, 32)
    with pytest.raises(ModelLoadError, match="fc1.weight"):
        load(config, tensors)


def test_an_image_of_another_size_is_refused(checkpoint):
    vision = load(*read(checkpoint[0]))
    with pytest.raises(ValueError, match="pixel_values"):
        vision.encode(torch.zeros(1, 3, 64, 64))


def test_importing_the_encoder_does_not_import_transformers():
    code = (
        "import sys\n"
        "import treadle.model.layers.siglip, treadle.model.families.gemma3_vision\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- llama.cpp's mmproj file

GGUF_LAYER = {
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
GGUF_GLOBAL = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
}


def write_mmproj(path: str, model, image_seq_length: int | None) -> None:
    """The model's encoder and projector as llama.cpp's converter writes them (`image_seq_length`:
    the processor's, from which it derives the pool; None: a file without the scale factor)."""
    from tests.support.vision_models import siglip_mmproj_writer

    vision = model.config.vision_config
    writer = siglip_mmproj_writer(path, model, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], "gemma3")
    writer.add_bool("clip.use_gelu", True)
    if image_seq_length is not None:
        scale = (vision.image_size // vision.patch_size) // int(image_seq_length**0.5)
        if scale != 4:
            writer.add_uint32("clip.vision.projector.scale_factor", scale)
    projector = model.model.multi_modal_projector
    writer.add_tensor("mm.input_projection.weight", projector.mm_input_projection_weight.detach().half().numpy())
    writer.add_tensor("mm.soft_emb_norm.weight", (projector.mm_soft_emb_norm.weight.detach() + 1).numpy())
    for name, t in model.model.vision_tower.state_dict().items():
        base, _, kind = name.rpartition(".")
        if base in GGUF_GLOBAL:
            gguf_name = f"{GGUF_GLOBAL[base]}.{kind}"
        else:
            _, _, layer, rest = base.split(".", 3)  # encoder.layers.N.<module>
            gguf_name = f"v.blk.{layer}.{GGUF_LAYER[rest]}.{kind}"
        writer.add_tensor(gguf_name, t.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_mmproj_gguf_file_gives_transformers_soft_tokens(checkpoint, tmp_path):
    _, model = checkpoint
    path = str(tmp_path / "mmproj.gguf")
    write_mmproj(path, model, image_seq_length=4)
    vision = Gemma3Vision.from_gguf(open_gguf(path), torch.float32)
    assert (vision.tokens_per_image, vision.image_size, vision.hidden_size) == (4, 32, TEXT["hidden_size"])
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    kept = projection.detach().clone()
    with torch.no_grad():
        projection.copy_(kept.half().float())  # the file's float16 projection
    x = pixels(2)
    try:
        theirs = hf_soft_tokens(model, x)
    finally:
        with torch.no_grad():
            projection.copy_(kept)
    torch.testing.assert_close(vision.encode(x), theirs, atol=1e-5, rtol=1e-5)


def test_an_mmproj_file_without_a_scale_factor_pools_4_by_4(checkpoint, tmp_path):
    _, model = checkpoint
    path = str(tmp_path / "mmproj.gguf")
    write_mmproj(path, model, image_seq_length=None)
    vision = Gemma3Vision.from_gguf(open_gguf(path), torch.float32)
    assert vision.tokens_per_image == 1  # 4 x 4 patches, one 4 x 4 pool
    soft = vision.encode(pixels(2))
    assert soft.shape == (2, 1, TEXT["hidden_size"]) and bool(torch.isfinite(soft).all())


def test_a_gguf_file_of_another_projector_is_refused(tmp_path):
    import gguf

    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", "idefics3")
    writer.add_tensor("v.post_ln.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="not a Gemma 3 mmproj"):
        Gemma3Vision.from_gguf(open_gguf(path), torch.float32)
