"""Gemma 3 that sees, end to end offline: a tiny random Gemma3ForConditionalGeneration folder (its
tokenizer with Gemma's image tokens, its image processor's config) served by `LLM`, greedy tokens
against transformers' `generate` on the same weights, in float32: one image, two images, prompts
batched, the same image again (a prefix hit and an encoder-cache hit), and another image after the
same text (no hit).

The reference is built independently of treadle's front end: transformers' own PIL image processor
makes its pixel values, and the prompt's image tokens are written here as Gemma3Processor writes them
("\\n\\n<start_of_image>" + 16 soft tokens + "<end_of_image>\\n\\n"). The text model has a sliding
window (8) shorter than an image (16 tokens), so its local layers test that an image's tokens see
each other both ways within the window, as transformers' mask has them.
"""

import pytest
import torch

from tests.support.vision_models import picture, reference, save_gemma3_vlm
from treadle import LLM, SamplingParams

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_gemma3_vlm(str(tmp_path_factory.mktemp("gemma3_sees")))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder[0], dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
ONE = "The picture <start_of_image> shows"
TWO = "First <start_of_image> and then <start_of_image> compared:"


def run(llm, text, images, params=GREEDY):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0].outputs[0].token_ids


def test_one_image_and_two_match_transformers(folder, llm):
    a, b = picture(1), picture(2, size=(70, 33))
    assert run(llm, ONE, a) == reference(folder, NUM_TOKENS, ONE, [a])
    assert run(llm, TWO, [a, b]) == reference(folder, NUM_TOKENS, TWO, [a, b])


def test_prompts_batched_with_and_without_images_match_transformers(folder, llm):
    a, b, c = picture(3), picture(4), picture(5)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": a}},
        {"prompt": TWO, "multi_modal_data": {"image": [b, c]}},
        "A prompt without a picture",
    ]
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].outputs[0].token_ids == reference(folder, NUM_TOKENS, ONE, [a])
    assert outs[1].outputs[0].token_ids == reference(folder, NUM_TOKENS, TWO, [b, c])
    assert outs[2].outputs[0].token_ids == reference(folder, NUM_TOKENS, "A prompt without a picture", [])


def test_the_same_image_hits_both_caches_and_another_image_hits_neither(folder, llm):
    text = "A long enough introduction to fill a block or two of tokens, then <start_of_image> and a question"
    a, b = picture(6), picture(7)
    first = run(llm, text, a)
    stats = llm.stats()
    hits, cached = stats["encoder_cache"]["mm_cache_hits"], stats["prefix_cache_hits"]
    assert run(llm, text, a) == first == reference(folder, NUM_TOKENS, text, [a])
    stats = llm.stats()
    assert stats["encoder_cache"]["mm_cache_hits"] == hits  # the prefix cache covered the image: no encode at all
    assert stats["prefix_cache_hits"] > cached
    # the same text with another picture: the blocks holding the image's tokens do not match
    misses = stats["encoder_cache"]["mm_cache_misses"]
    assert run(llm, text, b) == reference(folder, NUM_TOKENS, text, [b])
    assert llm.stats()["encoder_cache"]["mm_cache_misses"] == misses + 1


def test_n_choices_encode_the_image_once(folder, llm):
    a = picture(8)
    misses = llm.stats()["encoder_cache"]["mm_cache_misses"]
    out = llm.generate(
        {"prompt": ONE + " twice", "multi_modal_data": {"image": a}},
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2),
    )[0]
    assert [c.token_ids for c in out.outputs][0] == [c.token_ids for c in out.outputs][1]
    assert llm.stats()["encoder_cache"]["mm_cache_misses"] == misses + 1


def test_markers_and_images_must_agree_and_a_text_model_refuses_images(llm):
    with pytest.raises(ValueError, match="2 <start_of_image> for 1 images"):
        run(llm, TWO, picture(1))
    text_only = LLM(dtype="float32", max_model_len=256, num_kv_blocks=16)  # the embedded default model
    with pytest.raises(ValueError, match="takes no images"):
        run(text_only, ONE, picture(1))


def test_a_chunked_prompt_never_cuts_an_image(folder):
    """A step budget of 20 tokens: the chunk before an image ends where the image begins, and each
    image (16 tokens) is computed in one step (beyond the stall cap if it must)."""
    llm = LLM(folder[0], dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=20)
    a, b = picture(11), picture(12)
    assert run(llm, TWO, [a, b]) == reference(folder, NUM_TOKENS, TWO, [a, b])
    assert llm.stats()["kv_blocks_used"] == 0


def test_an_image_longer_than_a_step_is_refused_naming_the_budget(folder):
    llm = LLM(folder[0], dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="more than a step computes .12, --max-num-batched-tokens"):
        run(llm, ONE, picture(1))
    assert llm.stats()["num_waiting"] == 0


def test_chat_with_image_parts_matches_generate_on_the_rendered_prompt(folder, llm):
    import base64
    import io

    a = picture(9)
    buf = io.BytesIO()
    a.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "See "}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    out = llm.chat(messages, GREEDY)[0].outputs[0].token_ids
    prompt = "<start_of_turn>user\nSee <start_of_image><end_of_turn>\n<start_of_turn>model\n"
    assert out == reference(folder, NUM_TOKENS, prompt, [a])
    pil = [{"role": "user", "content": [{"type": "text", "text": "See "}, {"type": "image_pil", "image_pil": a}]}]
    assert llm.chat(pil, GREEDY)[0].outputs[0].token_ids == out


def test_a_gguf_model_with_its_mmproj_beside_it_sees_as_transformers(folder, tmp_path):
    """The text model as a GGUF file and the encoder as llama.cpp's mmproj file beside it (found
    without --mmproj; its image processor read from the file's clip.vision keys). The mmproj holds
    the projection in float16, as the converter writes it: so does the reference here."""
    import copy

    from transformers import Gemma3ForCausalLM

    from tests.model.families.test_gemma3_vision import write_mmproj
    from tests.support.tiny_models import write_gguf
    from tests.support.vision_models import TOKENS_PER_IMAGE

    path, model, tok, image_config = folder
    text = Gemma3ForCausalLM(model.config.text_config).eval()
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    write_gguf(str(tmp_path / "tiny-vlm.gguf"), "gemma3", text, tok)
    write_mmproj(str(tmp_path / "mmproj-tiny-vlm-f32.gguf"), model, TOKENS_PER_IMAGE)
    rounded = copy.deepcopy(model)
    projection = rounded.model.multi_modal_projector.mm_input_projection_weight
    projection.data = projection.data.half().float()
    gguf_llm = LLM(str(tmp_path / "tiny-vlm.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64)
    a, b = picture(13), picture(14, size=(90, 40))
    assert run(gguf_llm, ONE, a) == reference((path, rounded, tok, image_config), NUM_TOKENS, ONE, [a])
    assert run(gguf_llm, TWO, [a, b]) == reference((path, rounded, tok, image_config), NUM_TOKENS, TWO, [a, b])
    assert LLM(str(tmp_path / "tiny-vlm.gguf"), dtype="float32", max_model_len=512, num_kv_blocks=64,
               mmproj=str(tmp_path / "mmproj-tiny-vlm-f32.gguf")).engine.worker.takes_images  # fmt: skip


def test_the_terminal_chat_and_run_take_an_image(folder, llm, tmp_path):
    """`treadle chat`'s /image PATH and `treadle run --image PATH` send the picture before the
    text, as LLM.chat does with the same message."""
    import io
    import subprocess
    import sys

    from treadle.chat import ChatSession

    a = picture(16)
    png = tmp_path / "cat.png"
    a.save(png)
    out = io.StringIO()
    session = ChatSession(llm.engine, out=out)
    session.params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    session.command(f"/image {png}")
    assert "image attached (56x40)" in out.getvalue()
    misses = llm.stats()["encoder_cache"]["mm_cache_misses"]
    session.reply("See")
    assert llm.stats()["encoder_cache"]["mm_cache_misses"] == misses + 1  # the picture went with it
    message = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "See"}]}]
    expected = llm.chat(message, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert out.getvalue().endswith(expected + "\n")
    assert session.images == []  # sent with that message only
    session.command(f"/image {tmp_path / 'missing.png'}")
    assert "missing.png" in out.getvalue().splitlines()[-1]
    run = subprocess.run(
        [sys.executable, "-m", "treadle", "run", "--model", folder[0], "--dtype", "float32", "--image", str(png),
         "--temperature", "0", "--max-tokens", "6", "--max-model-len", "512", "See"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"


def test_an_image_s_blocks_come_back_from_the_host_tier_under_the_same_keys(folder):
    """A pool of 16 blocks that other prompts flush: the same text and picture come back from the
    host tier (their blocks keyed with the image's hash) with transformers' tokens; the same text
    with another picture takes nothing of the image's blocks from it."""
    llm = LLM(folder[0], dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=16, kv_offload_bytes=1 << 24)
    text = "A long enough introduction to fill a block or two of tokens, then <start_of_image> and a question"
    a, b = picture(17), picture(18)
    first = run(llm, text, a)
    for i in range(6):  # other prompts take the pool: the image's blocks go to the host tier
        llm.generate(f"{i} flushes the pool with a prompt of its own that fills a few blocks of tokens", GREEDY)
    hits = llm.stats()["kv_tiers"]["host"]["hits"]
    assert run(llm, text, a) == first == reference(folder, NUM_TOKENS, text, [a])
    hits_a = llm.stats()["kv_tiers"]["host"]["hits"] - hits
    assert hits_a >= 3  # the text's blocks and the image's
    hits = llm.stats()["kv_tiers"]["host"]["hits"]
    assert run(llm, text, b) == reference(folder, NUM_TOKENS, text, [b])
    assert llm.stats()["kv_tiers"]["host"]["hits"] - hits < hits_a  # the blocks with a's tokens do not match b


def test_the_bf16_default_gives_one_answer_alone_batched_chunked_and_cached(folder):
    """The user's default on a bf16 CPU: treadle's attention kernel, whose image rows read their
    image's later keys. Batch-invariant, so a picture's answer is the same alone, beside other
    prompts, chunked at a small budget and after a prefix hit."""
    from treadle.model.kernels import paged

    if not paged.usable(torch.bfloat16, torch.device("cpu"), 4, 2, 16):
        pytest.skip("treadle's attention kernel cannot be built here")
    llm = LLM(folder[0], dtype="bfloat16", max_model_len=512, num_kv_blocks=64)
    assert llm.engine.runner.attention_kernel
    a, b = picture(23), picture(24, size=(70, 33))  # a pair whose answer needs the images seen both ways
    alone = run(llm, TWO, [a, b])
    batched = (
        llm.generate([{"prompt": TWO, "multi_modal_data": {"image": [a, b]}}, "A prompt without a picture"], GREEDY)[0]
        .outputs[0]
        .token_ids
    )
    again = run(llm, TWO, [a, b])  # the prompt's blocks from the prefix cache
    chunked = LLM(folder[0], dtype="bfloat16", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=20)
    assert alone == batched == again == run(chunked, TWO, [a, b])
    # and near transformers' float32 answer: the first tokens agree (later ones may round apart)
    assert alone[:4] == reference(folder, NUM_TOKENS, TWO, [a, b])[:4]
