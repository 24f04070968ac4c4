"""Tokenizers built from GGUF metadata, against transformers' GGUF tokenizer and by construction."""

import pytest

from treadle.text.detokenizer import IncrementalDetokenizer

HARD_STRINGS = [
    "Hello world",
    "1234567890 and 3.14159 and 1,000,000",
    "   leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nwindows",
    "emoji: 🎉🚀👩‍👩‍👧 done",
    "中文字符和日本語のテキスト、한국어",
    "Ünïcödé àccents ß œ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # square",
    "<|endoftext|> special in the middle <|im_end|>",
    "don't you'll I'm we've they're",
    "",
]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_encode_matches_transformers(llm, hf_tokenizer, text):
    assert llm.tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_decode_round_trips(llm, text):
    tok = llm.tokenizer
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skippable(llm):
    tok = llm.tokenizer
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_stop_set_contains_eos(llm):
    assert llm.tokenizer.eos_token_id in llm.tokenizer.stop_token_ids


def test_incremental_detokenizer_emits_whole_characters(llm):
    tok = llm.tokenizer
    text = "naïve 🎉 中文 ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji is several byte tokens: some pushes emit nothing until it is complete
    assert "" in pieces


def test_chat_template_renders_with_generation_prompt(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in text


def test_chat_template_is_sandboxed(llm):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception) as e:
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)
    assert "unsafe" in str(e.value).lower() or "access" in str(e.value).lower()


def test_failing_chat_template_is_a_value_error(llm):
    with pytest.raises(ValueError, match="chat template failed"):
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ 1 + 'a' }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{{ raise_exception('roles must alternate') }}"
        )


def test_invalid_utf8_comes_out_as_replacement_characters_not_held_for_ever(llm):
    """Byte tokens that no later token completes (0xFF, lone continuation bytes, as a random model
    emits them) are sent as U+FFFD within MAX_HELD_TOKENS pushes; whole characters still come whole."""
    from treadle.text.detokenizer import MAX_HELD_TOKENS

    tok = llm.tokenizer
    bad = [t for t in range(llm.engine.model_config.vocab_size) if tok.decode([t], False) == "\ufffd"]
    assert bad, "the vocabulary has byte tokens"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.push(bad[0]) for _ in range(40)]
    assert "\ufffd" in "".join(pieces)
    assert max(len(p) for p in pieces[: MAX_HELD_TOKENS + 1]) > 0  # not held past the bound
    assert len(detok.tokens) <= MAX_HELD_TOKENS + 1  # the window stays small
    ids = tok.encode("🎉 ok")
    assert "".join(detok.push(t) for t in ids).endswith("🎉 ok")
