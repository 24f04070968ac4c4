"""Rotary embeddings (model/layers/rotary.py): the rotation against rotate-half, the tables, RoPE scaling
against transformers, and the C kernel's bits on bf16 and float32 rows."""

import pytest
import torch

from treadle.model.config import RopeConfig
from treadle.model.kernels import rowops
from treadle.model.layers.rotary import RotaryEmbedding, apply_rotary

needs_rowops = pytest.mark.skipif(not rowops.available(), reason="no C compiler: the torch operations run")


def test_rotary_matches_rotate_half():
    head_dim = 32
    rope = RopeConfig(theta=10000.0)
    emb = RotaryEmbedding(rope, head_dim, 256)
    positions = torch.tensor([0, 5, 17, 255])
    x = torch.randn(4, 3, head_dim)
    cos, signed_sin = emb.tables(positions)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(positions.double(), inv)
    ang = torch.cat((ang, ang), -1).unsqueeze(1)
    half = head_dim // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), -1)
    expected = x.double() * ang.cos() + rotate_half.double() * ang.sin()
    # a float32 angle near 255 rad is within half an ulp (7.6e-6) of the exact one: times x (up to ~4), ~3e-5
    torch.testing.assert_close(apply_rotary(x, cos, signed_sin).double(), expected, rtol=1e-5, atol=1e-4)


def test_rotary_tables_hold_each_frequency_once():
    """The tables keep dim/2 frequencies per position (the two halves' values are the same numbers)
    and widen only a step's rows: half the memory of full-width tables, the same values."""
    rope = RopeConfig(theta=500000.0, attention_factor=1.25)
    emb = RotaryEmbedding(rope, 64, 1000)
    assert emb.cos.shape == emb.sin.shape == (1000, 32) and emb.cos.dtype == torch.float32
    positions = torch.tensor([0, 3, 999, 3])
    cos, signed_sin = emb.tables(positions)
    freqs = torch.outer(
        torch.arange(1000, dtype=torch.float32),
        (1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float(),
    )
    full = torch.cat((freqs, freqs), -1)  # the full-width table, computed whole as before
    assert cos.shape == signed_sin.shape == (4, 1, 64)
    torch.testing.assert_close(cos[:, 0], (full.cos() * 1.25)[positions], rtol=0, atol=0)
    torch.testing.assert_close(
        signed_sin[:, 0], (torch.cat((-freqs.sin(), freqs.sin()), -1) * 1.25)[positions], rtol=0, atol=0
    )


def test_rotary_tables_fill_as_positions_are_reached_with_the_whole_tables_values():
    """On the CPU a table is filled FILL positions at a time, as positions are first reached: the
    rest of it is never written (so never resident). A position's values are those of the table
    computed whole, whichever step first reached it; a position past the table is refused."""
    rope = RopeConfig(theta=10000.0, attention_factor=0.75)
    emb = RotaryEmbedding(rope, 64, 1000)
    fill = RotaryEmbedding.FILL
    assert emb.filled == 0 and fill < 1000 // 3
    freqs = torch.outer(
        torch.arange(1000, dtype=torch.float32),
        (1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float(),
    )
    whole_cos, whole_sin = freqs.cos() * 0.75, freqs.sin() * 0.75
    emb.tables(torch.tensor([3, 1]))
    assert emb.filled == fill
    emb.tables(torch.tensor([2 * fill + 5]))  # a jump: every block before it too
    assert emb.filled == 3 * fill
    assert torch.equal(emb.cos[: emb.filled], whole_cos[: emb.filled]) and torch.equal(
        emb.sin[: emb.filled], whole_sin[: emb.filled]
    )
    emb.cover(1000)  # the last block, cut to the table
    assert emb.filled == 1000 and torch.equal(emb.cos, whole_cos) and torch.equal(emb.sin, whole_sin)
    with pytest.raises(ValueError, match="beyond the rotary tables"):
        emb.cover(1001)


# ---------------------------------------------------------------- RoPE scaling: yarn and dynamic NTK


def _rope_model(tmp_path, rope_parameters: dict, max_position: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position,
                         rms_norm_eps=1e-6, initializer_range=0.15,
                         rope_parameters={"rope_theta": 10000.0, **rope_parameters}, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path))
    tok.save(str(tmp_path / "tokenizer.json"))
    return model


@pytest.mark.parametrize(
    "rope, max_position, source",
    [
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            128,
            "hf",
        ),  # yarn, the paper's temperature
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            128,
            "gguf",
        ),  # llama.cpp's yarn keys
        (
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 16,
                "beta_slow": 2,
                "attention_factor": 1.3,
            },
            128,
            "hf",
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, 128, "hf"),  # within the context: the plain base, as transformers
    ],
)
def test_rope_scaling_types_match_transformers(tmp_path, rope, max_position, source):
    from tests.support.reference import assert_matches_reference, greedy_continuation, hf_greedy
    from tests.support.tiny_models import tiny_tokenizer, write_gguf
    from treadle import LLM, SamplingParams

    model = _rope_model(tmp_path, rope, max_position)
    path = str(tmp_path)
    if source == "gguf":
        path = str(tmp_path / "yarn.gguf")
        write_gguf(path, "llama", model, tiny_tokenizer())
    llm = LLM(path, dtype="float32", max_model_len=max_position)
    assert llm.engine.core.model_config.rope.scaling_type == rope["rope_type"]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (70, 12)]  # past yarn's original context
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref, rows = hf_greedy(model, ids, 24)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, greedy_continuation(llm))


def test_dynamic_ntk_rescales_its_base_once_for_an_engine_past_the_context():
    """Past the model's context, dynamic NTK's base is transformers' for a sequence of the
    engine's length (vLLM's choice: one table, consistent with the cached keys)."""
    from treadle.model.config import RopeConfig
    from treadle.model.layers.rotary import rope_inverse_frequencies

    rope = RopeConfig(scaling_type="dynamic", factor=2.0, original_max_position=64)
    assert torch.allclose(rope_inverse_frequencies(rope, 16, 64), rope_inverse_frequencies(RopeConfig(), 16, 64))
    theta = 10000.0 * ((2.0 * 256 / 64) - 1.0) ** (16 / 14)
    assert torch.allclose(
        rope_inverse_frequencies(rope, 16, 256), rope_inverse_frequencies(RopeConfig(theta=theta), 16)
    )


@needs_rowops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rot, head_dim", [(64, 64), (256, 256), (32, 80)])
def test_rotary_in_c_is_the_torch_formulas_bits_for_every_row_count(rot, head_dim, dtype):
    """The C rotation (bf16 and float32 rows) against transformers' formula in torch, each product
    and the sum rounded to float32 apart, for one row and 37 rows, from a strided q/k view; partial
    rotary passes the rest of the head through. A row's bits are the same alone and among others
    (torch's addcmul fuses the multiply-add on some shapes and not on others)."""
    g = torch.Generator().manual_seed(1)
    heads, t = 5, 37
    qkv = (torch.randn(t, heads + 2, head_dim, generator=g) * 3).to(dtype)
    x = qkv[:, :heads]  # the q/k part of a projection's output: rows strided
    positions = torch.randint(0, 4096, (t,), generator=g)
    emb = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=rot if rot < head_dim else None), head_dim, 4096)
    cos, signed_sin = emb.tables(positions)
    x32 = x[..., :rot].float()
    turned = ((x32 * cos) + (x32.roll(rot // 2, dims=-1) * signed_sin)).to(dtype)  # two products, then the sum
    expected = torch.cat([turned, x[..., rot:]], dim=-1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    whole = apply_rotary(x, cos, signed_sin)
    assert whole.dtype == dtype and torch.equal(whole.view(bits), expected.view(bits))
    for row in (0, 17, 36):
        alone = apply_rotary(x[row : row + 1], cos[row : row + 1], signed_sin[row : row + 1])
        assert torch.equal(alone.view(bits), whole[row : row + 1].view(bits))
