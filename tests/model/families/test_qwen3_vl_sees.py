"""Qwen3-VL that sees, end to end offline: a tiny random Qwen3VLForConditionalGeneration folder
(tests/support/qwen3_vl_models.py) served by `LLM`, greedy tokens against transformers' `generate`
on the same weights, in float32: one image, two images of different sizes, prompts batched with a
text-only one; Qwen3-VL-MoE in both layouts of its stacked experts.

The tiny model is made so that these can fail: its encoder's output is transformers' (main and
DeepStack embeddings, the learned positions interpolated), and the tokens change where DeepStack's
adds are left out or the M-RoPE frequencies are sectioned (Qwen2.5-VL's) instead of interleaved.
"""

import pytest
import torch

from tests.support.qwen3_vl_models import processed, reference, save_qwen3_vl
from tests.support.vision_models import picture
from treadle import LLM, SamplingParams
from treadle.model.config import RopeConfig
from treadle.model.layers.mrope import MultimodalRotaryEmbedding

NUM_TOKENS = 12
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"The picture {IMAGE} shows"
TWO = f"First {IMAGE} and then {IMAGE} compared:"
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_sees")))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder[0], dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)


def run(llm, text, images, params=GREEDY):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0].outputs[0].token_ids


def test_interleaved_mrope_tables_are_transformers_rotary(folder):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    positions = torch.tensor([[0, 4, 4, 4, 9, 300], [0, 4, 5, 6, 9, 300], [0, 4, 6, 5, 9, 300]])
    rotary = Qwen3VLTextRotaryEmbedding(folder[1].config.text_config)
    want_cos, want_sin = rotary(torch.zeros(1), positions[:, None])
    cos, signed_sin = MultimodalRotaryEmbedding(RopeConfig(theta=100.0), 16, 512, [2, 3, 3], True).tables(positions)
    torch.testing.assert_close(cos[:, 0], want_cos[0])
    torch.testing.assert_close(torch.cat((-signed_sin[:, 0, :8], signed_sin[:, 0, 8:]), -1), want_sin[0])
    sectioned, _ = MultimodalRotaryEmbedding(RopeConfig(theta=100.0), 16, 512, [2, 3, 3]).tables(positions)
    assert not torch.allclose(sectioned, cos)  # the two layouts differ on these positions


def test_the_encoder_is_transformers_visual_with_deepstack(folder, llm):
    _, model, _ = folder
    for img in (picture(1), picture(2, size=(70, 33))):  # patch grids (8 x 8, 4 x 8) unlike the 4 x 4 positions
        inputs = processed([img])
        with torch.no_grad():
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        want = torch.cat([out.pooler_output[0]] + [features[0] for features in out.deepstack_features], dim=-1)
        got = llm.engine.core.worker.runner.model.encode_image(
            inputs["pixel_values"], {"image_grid_thw": inputs["image_grid_thw"].tolist()}
        )
        assert got.shape == (want.shape[0], 3 * 64)  # the main embeddings and two DeepStack's, side by side
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


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


def test_the_tokens_change_without_deepstack_or_without_interleaving(folder, llm):
    """The tiny model can tell: each mistake, made on purpose, changes the greedy tokens (new
    pictures each time: no prefix hit)."""
    model = llm.engine.core.worker.runner.model
    a, b = picture(10), picture(11)
    want_a, want_b = reference(folder, NUM_TOKENS, ONE, [a]), reference(folder, NUM_TOKENS, ONE, [b])
    deepstack = model.vision.deepstack
    model.vision.deepstack = 0  # the main embeddings alone
    try:
        assert run(llm, ONE, a) != want_a
    finally:
        model.vision.deepstack = deepstack
    axis = model.rotary.axis
    model.rotary.axis = None  # Qwen2.5-VL's sections
    try:
        assert run(llm, ONE, b) != want_b
    finally:
        model.rotary.axis = axis


def test_qwen3_vl_moe_in_both_expert_layouts_matches_transformers(tmp_path):
    """Qwen3-VL-MoE: the experts as transformers saves them, and transposed as Qwen's files store
    them ([experts, hidden, 2 * intermediate], [experts, intermediate, hidden])."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = save_qwen3_vl(str(tmp_path / "saved"), moe=True)
    qwen = str(tmp_path / "qwen")
    shutil.copytree(folder[0], qwen)
    tensors = load_file(f"{qwen}/model.safetensors")
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, f"{qwen}/model.safetensors", metadata={"format": "pt"})
    a, b, c = picture(3), picture(4, size=(33, 70)), picture(5)
    want = [reference(folder, NUM_TOKENS, ONE, [a]), reference(folder, NUM_TOKENS, TWO, [b, c])]
    for path in (folder[0], qwen):
        llm = LLM(path, dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)
        outs = llm.generate(
            [{"prompt": ONE, "multi_modal_data": {"image": a}}, {"prompt": TWO, "multi_modal_data": {"image": [b, c]}}],
            GREEDY,
        )
        assert [out.outputs[0].token_ids for out in outs] == want


def test_a_qwen3vl_gguf_with_its_mmproj_beside_it_sees_as_transformers(tmp_path):
    """Qwen3-VL as llama.cpp ships it: the language model as a `qwen3vl` GGUF (n_deepstack_layers),
    the tower as the `qwen3vl_merger` mmproj file beside it, its DeepStack mergers under the blocks
    they read (`is_deepstack_layers`: blocks 0 and 2 here, so that a merger read from the wrong
    block shows), its image processor from the file's keys (the processor's default pixel bounds)."""
    from tests.support.qwen3_vl_models import IMAGE_CONFIG
    from tests.support.qwen_vl_models import write_mmproj, write_text_gguf

    pair = save_qwen3_vl(str(tmp_path / "folder"), deepstack_visual_indexes=[0, 2])
    write_text_gguf(str(tmp_path / "tiny-qwen3-vl.gguf"), pair)
    write_mmproj(str(tmp_path / "mmproj-tiny-qwen3-vl-f32.gguf"), pair, IMAGE_CONFIG)
    llm = LLM(str(tmp_path / "tiny-qwen3-vl.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64)
    images = {k: v for k, v in IMAGE_CONFIG.items() if k not in ("min_pixels", "max_pixels")}
    a, b = picture(12, size=(64, 64)), picture(13, size=(70, 33))
    _, model, _ = pair
    inputs = processed([a], images)
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    want = torch.cat([out.pooler_output[0]] + [features[0] for features in out.deepstack_features], dim=-1)
    got = llm.engine.core.worker.runner.model.encode_image(
        inputs["pixel_values"], {"image_grid_thw": inputs["image_grid_thw"].tolist()}
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert run(llm, ONE, a) == reference(pair, NUM_TOKENS, ONE, [a], images)
    assert run(llm, TWO, [a, b]) == reference(pair, NUM_TOKENS, TWO, [a, b], images)
    # the bf16 default on the same pair (M-RoPE, DeepStack): the picture is read, and a prompt's
    # tokens are the same alone, batched with a text prompt, and again from the prefix cache
    bf16 = LLM(str(tmp_path / "tiny-qwen3-vl.gguf"), dtype="bfloat16", max_model_len=512, num_kv_blocks=64)
    alone = run(bf16, ONE, a)
    batched = bf16.generate([{"prompt": ONE, "multi_modal_data": {"image": a}}, "Some text alone"], GREEDY)
    assert batched[0].outputs[0].token_ids == alone == run(bf16, ONE, a) != run(bf16, ONE, b)


def test_an_mmproj_whose_deepstack_disagrees_with_the_text_model_is_refused(folder, tmp_path):
    from tests.support.qwen3_vl_models import IMAGE_CONFIG
    from tests.support.qwen_vl_models import write_mmproj, write_text_gguf
    from treadle.model.config import ModelLoadError

    write_text_gguf(str(tmp_path / "tiny-qwen3-vl.gguf"), folder)  # two DeepStack layers
    write_mmproj(str(tmp_path / "mmproj.gguf"), save_qwen3_vl(str(tmp_path / "f"), deepstack_visual_indexes=[1]),
                 IMAGE_CONFIG)  # fmt: skip
    with pytest.raises(ModelLoadError, match="1 DeepStack layers; the text model's file says n_deepstack_layers = 2"):
        LLM(str(tmp_path / "tiny-qwen3-vl.gguf"), dtype="float32", max_model_len=256, num_kv_blocks=16)


def test_a_qwen3vlmoe_gguf_with_its_mmproj_sees_as_transformers(tmp_path):
    """Qwen3-VL-MoE as llama.cpp ships it: a `qwen3vlmoe` GGUF (the experts stacked per kind, the
    chosen weights renormalised, the head not tied) and the same `qwen3vl_merger` mmproj."""
    from tests.support.qwen3_vl_models import IMAGE_CONFIG
    from tests.support.qwen_vl_models import write_mmproj, write_text_gguf

    pair = save_qwen3_vl(str(tmp_path / "folder"), moe=True)
    write_text_gguf(str(tmp_path / "tiny-qwen3-vl-moe.gguf"), pair)
    write_mmproj(str(tmp_path / "mmproj-tiny-qwen3-vl-moe-f32.gguf"), pair, IMAGE_CONFIG)
    llm = LLM(str(tmp_path / "tiny-qwen3-vl-moe.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64)
    images = {k: v for k, v in IMAGE_CONFIG.items() if k not in ("min_pixels", "max_pixels")}
    a, b = picture(14, size=(64, 64)), picture(15, size=(70, 33))
    assert run(llm, ONE, a) == reference(pair, NUM_TOKENS, ONE, [a], images)
    assert run(llm, TWO, [a, b]) == reference(pair, NUM_TOKENS, TWO, [a, b], images)
