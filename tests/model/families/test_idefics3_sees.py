"""SmolVLM and Idefics3 that see, end to end offline: tiny random SmolVLMForConditionalGeneration and
Idefics3ForConditionalGeneration folders (a Llama text model, SigLIP, the pixel-shuffle connector)
served by `LLM`, greedy tokens against transformers' `generate` on the same weights, in float32: one
image whole (image splitting off), a wide image cut into a grid of tiles and the global image, two
images, prompts batched with a text-only one, a chat message with an image.

The reference is built independently of treadle's front end: transformers' own PIL image processor
makes its pixel values (and says each image's rows and columns of tiles), and transformers'
`get_image_prompt_string` writes each image's tokens into the prompt.

SmolVLM's tiles are 6 x 6 patches of 8 px, 2 x 2 patches to a token (9 tokens a tile). Idefics3's
are 25 x 25 patches of 4 px, 5 x 5 to a token: with 25 per side transformers' bucketed position
coordinates are not the patch's own index (float rounding), which the encoder must reproduce.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.support.idefics3_models import reference, save_idefics3_vlm, transformers_pixels
from tests.support.vision_models import picture
from treadle import LLM, SamplingParams
from treadle.model.config import ModelLoadError
from treadle.model.families.idefics3 import Idefics3Model
from treadle.model.families.idefics3_vision import Idefics3Vision
from treadle.model.loading.hf_loader import HFConfig

NUM_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
ONE = "The picture <image> shows"
TWO = "First <image> and then <image> compared:"
WIDE, SQUARISH = (40, 100), (40, 56)  # (height, width): a 1 x 2 grid of tiles, a 2 x 2 grid


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    return save_idefics3_vlm(str(tmp_path_factory.mktemp("smolvlm_sees")))


@pytest.fixture(scope="module")
def whole(smolvlm, tmp_path_factory):
    """The same SmolVLM with image splitting off: each image one tile."""
    path = str(tmp_path_factory.mktemp("smolvlm_whole") / "model")
    shutil.copytree(smolvlm["path"], path)
    image_config = {**smolvlm["image_config"], "do_image_splitting": False}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(image_config, f)
    return {**smolvlm, "path": path, "image_config": image_config}


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return save_idefics3_vlm(
        str(tmp_path_factory.mktemp("idefics3_sees")), "idefics3", patch=4, patches_per_side=25, scale_factor=5
    )


def serve(folder) -> LLM:
    return LLM(folder["path"], dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(smolvlm):
    return serve(smolvlm)


def run(llm, text, images):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0].outputs[0].token_ids


def encoder(folder) -> Idefics3Vision:
    with open(os.path.join(folder["path"], "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(folder["path"], "model.safetensors"), "pt") as f:
        tensors = {name.removeprefix("model."): f.get_tensor(name) for name in f.keys()}
    names = [name for name in tensors if Idefics3Vision.is_vision_tensor(name)]
    return Idefics3Vision.from_hf(config, 64, tensors.__getitem__, names, torch.float32)


@pytest.mark.parametrize("name", ["smolvlm", "idefics3"])
def test_the_encoder_gives_transformers_image_features_tile_by_tile(name, request):
    folder = request.getfixturevalue(name)
    vision = encoder(folder)
    processed = transformers_pixels(folder, [picture(1, size=WIDE), picture(2, size=SQUARISH)])
    expected = folder["model"].model.get_image_features(processed["pixel_values"], processed["pixel_attention_mask"])
    got = vision.encode(processed["pixel_values"][0]).flatten(0, 1)
    torch.testing.assert_close(got, torch.cat(list(expected.pooler_output)), rtol=1e-5, atol=1e-5)
    side = vision.tower.config.patches_per_side
    identity = torch.equal(vision.positions(side, side, "cpu"), torch.arange(side * side))
    assert identity == (side == 6)  # 25 per side: some patches take the position before their own


def test_one_image_whole_matches_transformers_and_another_image_changes_the_answer(whole):
    llm = serve(whole)
    a, b = picture(1), picture(2)
    assert run(llm, ONE, a) == reference(whole, NUM_TOKENS, ONE, [a])
    assert run(llm, ONE, b) == reference(whole, NUM_TOKENS, ONE, [b]) != run(llm, ONE, a)


def test_a_wide_image_split_into_tiles_matches_transformers(smolvlm, llm):
    a = picture(3, size=WIDE)
    assert transformers_pixels(smolvlm, [a])["pixel_values"].shape[1] == 3  # two tiles and the global image
    assert run(llm, ONE, a) == reference(smolvlm, NUM_TOKENS, ONE, [a])


def test_two_images_match_transformers(smolvlm, llm):
    a, b = picture(4, size=WIDE), picture(5, size=SQUARISH)
    assert run(llm, TWO, [a, b]) == reference(smolvlm, NUM_TOKENS, TWO, [a, b])


def test_prompts_batched_with_and_without_images_match_transformers(smolvlm, llm):
    a, b, c = picture(6, size=WIDE), picture(7), picture(8, size=WIDE)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": a}},
        "A prompt without a picture",
        {"prompt": TWO, "multi_modal_data": {"image": [b, c]}},
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs[0] == reference(smolvlm, NUM_TOKENS, ONE, [a])
    assert outs[1] == reference(smolvlm, NUM_TOKENS, "A prompt without a picture", [])
    assert outs[2] == reference(smolvlm, NUM_TOKENS, TWO, [b, c])


def test_a_chat_message_with_an_image_matches_transformers(smolvlm, llm):
    a = picture(9, size=WIDE)
    content = [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "What is this?"}]
    out = llm.chat([{"role": "user", "content": content}], GREEDY)[0].outputs[0].token_ids
    text = "<|im_start|>User: <image>What is this?<end_of_utterance>\nAssistant:"
    assert out == reference(smolvlm, NUM_TOKENS, text, [a])


def test_idefics3_with_bucketed_positions_matches_transformers(idefics3):
    llm = serve(idefics3)
    a, b = picture(10, size=WIDE), picture(11)
    assert run(llm, ONE, a) == reference(idefics3, NUM_TOKENS, ONE, [a])
    assert run(llm, TWO, [a, b]) == reference(idefics3, NUM_TOKENS, TWO, [a, b])


@pytest.mark.parametrize(
    "config",
    [
        {"text_config": {"hidden_size": 64, "num_attention_heads": 4, "tie_word_embeddings": True}},
        {"text_config": {"model_type": "llama", "vocab_size": 300, "rms_norm_eps": 1e-5}, "tie_word_embeddings": True},
        {},
    ],
)
def test_the_text_model_is_read_with_transformers_defaults(config):
    """A key text_config leaves out takes LlamaConfig's default (no text_config: the composite's
    rms_norm_eps); only the top level's tie_word_embeddings ties the head."""
    from transformers import SmolVLMConfig

    expected = SmolVLMConfig(**config)
    got = Idefics3Model.config_from_hf(HFConfig("m", {"model_type": "smolvlm", **config}, "smolvlm"))
    text = expected.text_config
    assert (got.vocab_size, got.hidden_size, got.intermediate_size, got.num_layers, got.num_heads) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads
    )  # fmt: skip
    assert (got.rms_norm_eps, got.max_position, got.tie_word_embeddings) == (
        text.rms_norm_eps, text.max_position_embeddings, expected.tie_word_embeddings
    )  # fmt: skip


def test_a_text_model_other_than_llama_is_refused():
    hf = HFConfig("m", {"model_type": "idefics3", "text_config": {"model_type": "mistral"}}, "idefics3")
    with pytest.raises(ModelLoadError, match="text_config.model_type = 'mistral': expected llama"):
        Idefics3Model.config_from_hf(hf)


def test_a_gguf_text_model_with_its_idefics3_mmproj_beside_it_sees_as_transformers(smolvlm, tmp_path):
    """SmolVLM as llama.cpp ships it: the Llama text model as a GGUF file, the encoder and connector
    as the mmproj file beside it (found without --mmproj); the image processor (tile size, first
    resize, tokens per tile, mean and std) read from the mmproj's clip.vision keys."""
    from transformers import LlamaForCausalLM

    from tests.support.idefics3_models import write_mmproj
    from tests.support.tiny_models import write_gguf

    model = smolvlm["model"]
    text = LlamaForCausalLM(model.config.text_config).eval()
    text.model.load_state_dict(model.model.text_model.state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    write_gguf(str(tmp_path / "tiny-smolvlm.gguf"), "llama", text, smolvlm["tokenizer"])
    write_mmproj(str(tmp_path / "mmproj-tiny-smolvlm-f32.gguf"), smolvlm)
    llm = LLM(str(tmp_path / "tiny-smolvlm.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64)
    a, b = picture(10, size=WIDE), picture(11, size=SQUARISH)
    assert run(llm, ONE, a) == reference(smolvlm, NUM_TOKENS, ONE, [a])
    assert run(llm, TWO, [a, b]) == reference(smolvlm, NUM_TOKENS, TWO, [a, b])
    # the bf16 default on the same pair: the picture is read (another changes the tokens), and a
    # prompt's tokens are the same alone, batched with a text prompt, and again from the prefix cache
    bf16 = LLM(str(tmp_path / "tiny-smolvlm.gguf"), dtype="bfloat16", max_model_len=512, num_kv_blocks=64)
    alone = run(bf16, ONE, a)
    batched = bf16.generate([{"prompt": ONE, "multi_modal_data": {"image": a}}, "Some text alone"], GREEDY)
    assert batched[0].outputs[0].token_ids == alone == run(bf16, ONE, a) != run(bf16, ONE, b)


def test_an_mmproj_of_another_width_or_kind_is_refused(smolvlm, tmp_path):
    """An explicit --mmproj whose projector the model cannot read, or whose embeddings are not the
    text model's width, is a load error naming the file's problem."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.idefics3_models import write_mmproj
    from tests.support.tiny_models import write_gguf

    config = LlamaConfig(**{**smolvlm["model"].config.text_config.to_dict(), "hidden_size": 32, "head_dim": 8})
    write_gguf(str(tmp_path / "narrow.gguf"), "llama", LlamaForCausalLM(config).eval(), smolvlm["tokenizer"])
    write_mmproj(str(tmp_path / "mmproj.gguf"), smolvlm)
    with pytest.raises(ModelLoadError, match="64-wide embeddings; the model's hidden size is 32"):
        LLM(str(tmp_path / "narrow.gguf"), dtype="float32", max_model_len=256, num_kv_blocks=16)
