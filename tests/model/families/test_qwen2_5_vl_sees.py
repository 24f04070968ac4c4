"""Qwen2.5-VL that sees, end to end offline: a tiny random Qwen2_5_VLForConditionalGeneration folder
(tests/support/qwen_vl_models.py) served by `LLM`, greedy tokens against transformers' `generate`
on the same weights, in float32: one image, two images of different sizes, prompts batched with a
text-only one, a prompt chunked around its images, two choices; and Qwen2-VL, whose tower differs.

The text model's attention is sharp enough (q and k scaled up) that positions by index instead of
M-RoPE's change the tokens; the tower's attention windows (2 x 2 tokens) split every image.
"""

import pytest
import torch

from tests.support.qwen_vl_models import IMAGE_CONFIG, reference, save_qwen_vl
from tests.support.vision_models import picture
from treadle import LLM, SamplingParams
from treadle.model.config import RopeConfig
from treadle.model.layers.mrope import MropePositions, MultimodalRotaryEmbedding

NUM_TOKENS = 12
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"The picture {IMAGE} shows"
TWO = f"First {IMAGE} and then {IMAGE} compared:"
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen_vl(str(tmp_path_factory.mktemp("qwen2_5_vl_sees")))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder[0], dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)


def run(llm, text, images, params=GREEDY):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0].outputs[0].token_ids


def test_positions_are_transformers_rope_index_in_any_chunking(folder):
    _, model, _ = folder
    image, grids = model.config.image_token_id, [(1, 6, 6), (1, 8, 4)]  # 3 x 3 and 4 x 2 tokens
    ids = [5] * 4 + [image] * 9 + [6] * 3 + [image] * 8 + [7] * 2
    ids_t = torch.tensor([ids])
    expected, delta = model.model.get_rope_index(
        ids_t, mm_token_type_ids=(ids_t == image).int(), image_grid_thw=torch.tensor(grids)
    )
    positions = MropePositions([(4, 3, 3), (16, 4, 2)])
    assert positions(0, len(ids)).tolist() == expected[:, 0].tolist()
    assert positions.delta == int(delta)
    for start, n in [(0, 4), (16, 8), (13, 3), (24, 2), (26, 1)]:
        got = positions(start, n)
        want = expected[:, 0, start : start + n] if start < len(ids) else None
        if got.dim() == 1:  # text only: the three equal
            assert want is None or all(row == got.tolist() for row in want.tolist())
        else:
            assert got.tolist() == want.tolist()
    assert positions(26, 1).tolist() == [26 + int(delta)]  # a decode token: its index + delta


def test_mrope_tables_are_transformers_rotary(folder):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    positions = torch.tensor([[0, 4, 4, 4, 9, 300], [0, 4, 5, 6, 9, 300], [0, 4, 6, 5, 9, 300]])
    want_cos, want_sin = Qwen2_5_VLRotaryEmbedding(folder[1].config.text_config)(torch.zeros(1), positions[:, None])
    cos, signed_sin = MultimodalRotaryEmbedding(RopeConfig(theta=10000.0), 16, 512, [2, 3, 3]).tables(positions)
    torch.testing.assert_close(cos[:, 0], want_cos[0])
    torch.testing.assert_close(torch.cat((-signed_sin[:, 0, :8], signed_sin[:, 0, 8:]), -1), want_sin[0])


def test_the_encoder_is_transformers_visual(folder, llm):
    assert_encoder_is_transformers_visual(folder, llm, [picture(1), picture(2, size=(70, 33))])


def assert_encoder_is_transformers_visual(folder, llm, images, image_config=IMAGE_CONFIG):
    import numpy as np
    from transformers import Qwen2VLImageProcessorPil

    _, model, _ = folder
    settings = {k: v for k, v in image_config.items() if k != "image_processor_type"}
    for img in images:
        processed = Qwen2VLImageProcessorPil(**settings)(img, return_tensors="np")
        pixels = torch.tensor(np.asarray(processed["pixel_values"]))
        grid = torch.tensor(np.asarray(processed["image_grid_thw"]))
        with torch.no_grad():
            want = model.model.get_image_features(pixels, grid).pooler_output[0]
        got = llm.engine.core.worker.runner.model.encode_image(pixels, {"image_grid_thw": grid.tolist()})
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_image_and_two_of_different_sizes_match_transformers(folder, llm):
    a, b = picture(1), picture(2, size=(70, 33))
    assert run(llm, ONE, a) == reference(folder, NUM_TOKENS, ONE, [a])
    assert run(llm, TWO, [a, b]) == reference(folder, NUM_TOKENS, TWO, [a, b])


def test_prompts_batched_with_and_without_images_match_transformers(folder, llm):
    a, b, c = picture(3), picture(4, size=(33, 70)), picture(5)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": a}},
        "A prompt without a picture",
        {"prompt": TWO, "multi_modal_data": {"image": [b, c]}},
    ]
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].outputs[0].token_ids == reference(folder, NUM_TOKENS, ONE, [a])
    assert outs[1].outputs[0].token_ids == reference(folder, NUM_TOKENS, "A prompt without a picture", [])
    assert outs[2].outputs[0].token_ids == reference(folder, NUM_TOKENS, TWO, [b, c])


def test_a_prompt_chunked_around_its_images_and_its_choices_keep_their_positions(folder):
    """A step budget of 10 tokens: text chunks between and after the images run with their shifted
    positions alone; each choice of n = 2 decodes from the prompt's delta, and the same prompt again
    (a prefix hit) continues the same way."""
    llm = LLM(folder[0], dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=10)
    a, b = picture(6), picture(7, size=(70, 33))
    text = f"A longer introduction, then {IMAGE} and some words between, {IMAGE} and a question"
    want = reference(folder, NUM_TOKENS, text, [a, b])
    assert run(llm, text, [a, b]) == want
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [a, b]}}, SamplingParams(**{
        "max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True, "n": 2}))[0]  # fmt: skip
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_qwen2_vl_its_tower_without_windows_matches_transformers(tmp_path):
    """Qwen2-VL: the same language model, a tower of LayerNorm and QuickGELU over whole images."""
    folder = save_qwen_vl(str(tmp_path), "qwen2_vl")
    llm = LLM(folder[0], dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)
    a, b = picture(8), picture(9, size=(70, 33))
    assert run(llm, TWO, [a, b]) == reference(folder, NUM_TOKENS, TWO, [a, b])


# the image processor an mmproj file describes: the tower's patch and merge window, the processor's
# default pixel bounds and CLIP's mean and std (the converter writes no bounds)
MMPROJ_IMAGES = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2,
                 "temporal_patch_size": 2}  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl"])
def test_a_qwen2vl_gguf_with_its_mmproj_beside_it_sees_as_transformers(kind, tmp_path):
    """Qwen2.5-VL and Qwen2-VL as llama.cpp ships them: the language model as a `qwen2vl` GGUF (the
    M-RoPE split as rope.dimension_sections), the tower as the mmproj file beside it (q, k and v
    apart, the Conv3d as two frames; the window pattern as n_wa_pattern), its image processor from
    the file's keys. The file has no window size (clip.cpp's 112 px, every released model's): the
    folder's is 112 too, 7 x 7 tokens, which the 128 px picture's 8 x 8 crosses."""
    from tests.support.qwen_vl_models import write_mmproj, write_text_gguf

    pair = save_qwen_vl(str(tmp_path / "folder"), kind, window_size=112)
    write_text_gguf(str(tmp_path / "tiny-qwen-vl.gguf"), pair)
    write_mmproj(str(tmp_path / "mmproj-tiny-qwen-vl-f32.gguf"), pair, {})
    llm = LLM(str(tmp_path / "tiny-qwen-vl.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64)
    a, b = picture(10, size=(128, 128)), picture(11, size=(70, 33))
    assert_encoder_is_transformers_visual(pair, llm, [a, b], MMPROJ_IMAGES)
    assert run(llm, ONE, a) == reference(pair, NUM_TOKENS, ONE, [a], MMPROJ_IMAGES)
    assert run(llm, TWO, [a, b]) == reference(pair, NUM_TOKENS, TWO, [a, b], MMPROJ_IMAGES)
