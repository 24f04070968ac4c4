"""A SentencePiece (`tokenizer.ggml.model = llama`) vocabulary in a GGUF file, as llama.cpp writes one.

A real SentencePiece BPE model is trained here on a small corpus with byte fallback; its pieces,
scores and types go into GGUF metadata. treadle's tokenizer built from that metadata must agree with
SentencePiece itself and with transformers' GGUF tokenizer.
"""

import json
import os
import subprocess
import sys

import gguf
import pytest

from treadle.model.loading.gguf_file import read_metadata
from treadle.text import tokenizer as tokenizer_module
from treadle.text.tokenizer import tokenizer_from_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small corpus for a tokenizer test.",
    "Numbers like 12345 and 3.14 appear here, and so do words like tokenization.",
    "Le renard brun saute par-dessus le chien paresseux.",
    "the cat sat on the mat; the dog sat on the log.",
] * 20

TEXTS = [
    "Hello world",
    "the lazy cat jumps",
    "  two leading spaces",
    "tokenization of 98765",
    "émigré naïve café",
    "unseen ☃ snowman and 中文",
    "line one\nline two",
    " one leading space",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    prefix = str(folder / "sp")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        add_dummy_prefix=True,
        normalization_rule_name="identity",  # as Llama's SentencePiece models: no NFKC, spaces kept
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    path = str(folder / "spm.gguf")
    _write_spm_gguf(path, sp)
    return path, sp


def _vocabulary(sp):
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return tokens, scores, types


def _write_spm_gguf(path: str, sp, merges: list[str] | None = None) -> None:
    """sp's vocabulary as llama.cpp writes it (`merges`: also tokenizer.ggml.merges, as some files carry)."""
    tokens, scores, types = _vocabulary(sp)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_byte_level_gguf(path: str, tokens: list[str], merges: list[str]) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def ours(spm_gguf):
    path, _ = spm_gguf
    return tokenizer_from_gguf(path, read_metadata(path))


@pytest.mark.parametrize("text", TEXTS)
def test_matches_sentencepiece(spm_gguf, ours, text):
    _, sp = spm_gguf
    assert ours.encode(text, add_special_tokens=False) == sp.encode(text)
    assert ours.encode(text) == [sp.bos_id()] + sp.encode(text)


# transformers' GGUF tokenizer skips the space prefix on text that already starts with a space
# (SentencePiece and llama.cpp do not), so leading-space texts are compared with SentencePiece only.
@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ")])
def test_matches_transformers_gguf_tokenizer(spm_gguf, ours, text):
    from transformers import AutoTokenizer

    path, _ = spm_gguf
    folder, name = path.rsplit("/", 1)
    hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert ours.encode(text) == hf.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decodes_back(spm_gguf, ours, text):
    _, sp = spm_gguf
    ids = sp.encode(text)
    assert ours.decode(ids) == sp.decode(ids)


def test_space_prefix_after_special_tokens_as_llama_cpp(ours, spm_gguf):
    """llama.cpp prefixes a space to each text fragment after a special token."""
    _, sp = spm_gguf
    eos = sp.id_to_piece(sp.eos_id())
    assert ours.encode(f"hi{eos}there", add_special_tokens=False) == sp.encode("hi") + [sp.eos_id()] + sp.encode(
        "there"
    )


def test_the_derived_merges_are_cached_per_file_and_a_bad_cache_is_derived_again(spm_gguf, tmp_path, monkeypatch):
    """The SentencePiece merges are derived once per file (seconds for a 262k vocabulary) and kept
    under ~/.cache/treadle/tokenizers; an entry that cannot be read, is cut short or names a token
    the vocabulary lacks is replaced, never trusted."""
    path, sp = spm_gguf
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = tokenizer_from_gguf(path, read_metadata(path))
    (cached,) = (tmp_path / "treadle" / "tokenizers").iterdir()
    whole = cached.read_bytes()
    derived = []
    real = tokenizer_module._merges_from_scores
    monkeypatch.setattr(tokenizer_module, "_merges_from_scores", lambda *a: derived.append(1) or real(*a))
    again = tokenizer_from_gguf(path, read_metadata(path))
    text = TEXTS[0]
    assert first.encode(text) == again.encode(text) == [sp.bos_id(), *sp.encode(text)]
    assert derived == []  # the hit derived nothing
    n = sp.get_piece_size()
    for bad in (b"{not merges", whole[:-3], whole[:-8] + n.to_bytes(4, "little") + (0).to_bytes(4, "little")):
        cached.write_bytes(bad)
        rebuilt = tokenizer_from_gguf(path, read_metadata(path))
        assert rebuilt.encode(text) == first.encode(text)
        assert cached.read_bytes() == whole
    assert len(derived) == 3


FIRST_START = """
import json, os, sys
from treadle.text.tokenizer import tokenizer_from_gguf_file
tok = tokenizer_from_gguf_file(sys.argv[1])
assert tok.encode("hello world")
assert os.listdir(os.path.join(os.environ["XDG_CACHE_HOME"], "treadle", "tokenizers"))  # derived, not read
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "numpy")))
"""


def test_a_first_start_derives_the_merges_without_numpy(spm_gguf, tmp_path):
    """The front end derives a SentencePiece file's merges on its first start (no cache yet); numpy,
    imported for that, stayed in its resident set for the server's life (~15 MiB more than a
    later start)."""
    path, _ = spm_gguf
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", FIRST_START, path], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _growth_encoding(backend, texts) -> float:
    """MiB the process's resident set grows while `backend` encodes `texts`."""
    from treadle.utils import process_memory

    before = process_memory()["VmRSS"]
    for text in texts:
        backend.encode(text)
    return (process_memory()["VmRSS"] - before) / 2**20


def test_a_sentencepiece_vocabulary_keeps_no_word_cache(spm_gguf, tmp_path):
    """Without a pre-tokenizer a BPE "word" is a whole message: `tokenizers`' word cache kept ~6 KB
    for each distinct one under 256 bytes (up to 10,000: Gemma 3's front end grew 57 MiB). The GGUF
    file's tokenizer and a folder's tokenizer.json of that pipeline keep none; the same
    tokenizer.json loaded as is grows (the probe sees a cache)."""
    from tokenizers import Tokenizer as HFTokenizer

    from treadle.text.tokenizer import tokenizer_from_hf_folder

    path, sp = spm_gguf
    words = "the of and to in is that for it as was with be by on not this are or from at which".split()
    rng = __import__("random").Random(0)
    texts = lambda: [" ".join(rng.choice(words) for _ in range(40))[:160] for _ in range(2500)]  # noqa: E731 - under 256 bytes once spaces are "▁"
    ours = tokenizer_from_gguf(path, read_metadata(path))
    folder = tmp_path / "hf"
    folder.mkdir()
    ours.backend.save(str(folder / "tokenizer.json"))
    assert _growth_encoding(HFTokenizer.from_file(str(folder / "tokenizer.json")), texts()) > 8
    assert _growth_encoding(ours.backend, texts()) < 2
    hf = tokenizer_from_hf_folder(str(folder), {})
    assert _growth_encoding(hf.backend, texts()) < 2
    assert (
        hf.encode(TEXTS[0], add_special_tokens=False)
        == ours.encode(TEXTS[0], add_special_tokens=False)
        == sp.encode(TEXTS[0])
    )


def test_a_files_tokenizer_reads_its_metadata_once_and_keeps_none_of_it(spm_gguf, tmp_path, monkeypatch):
    """tokenizer_from_gguf_file hands the metadata it read to the vocabulary's build (a first
    start read Gemma 3's twice: 0.2 s), the merges derived or cached; once built, nothing holds
    the metadata (Gemma 3's lists are ~36 MB)."""
    import gc
    import weakref

    from treadle.model.loading import gguf_file

    path, sp = spm_gguf
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reads, alive = [], []
    read = gguf_file.read_metadata

    class Meta(dict):  # (a dict that a weak reference can see)
        pass

    def counted(p):
        reads.append(p)
        meta = Meta(read(p))
        alive.append(weakref.ref(meta))
        return meta

    monkeypatch.setattr(gguf_file, "read_metadata", counted)
    built = tokenizer_module.tokenizer_from_gguf_file(path)  # no cached merges: derived
    assert len(reads) == 1
    cached = tokenizer_module.tokenizer_from_gguf_file(path)
    assert len(reads) == 2
    assert built.encode(TEXTS[0]) == cached.encode(TEXTS[0]) == [sp.bos_id(), *sp.encode(TEXTS[0])]
    gc.collect()
    assert all(ref() is None for ref in alive), "a built tokenizer holds its file's metadata"
    with pytest.raises(ValueError):
        tokenizer_from_gguf(path, read_metadata(path), lazy=True, unread=["tokenizer.ggml.scores"], hand_over=True)


def test_the_cache_keeps_one_entry_per_file(spm_gguf, tmp_path, monkeypatch):
    """A file changed since its merges were cached gets a new entry that replaces the old one
    (none left behind per version); another file's entry stays."""
    import shutil

    path, sp = spm_gguf
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "treadle" / "tokenizers"
    one, two = str(tmp_path / "one.gguf"), str(tmp_path / "two.gguf")
    shutil.copy(path, one)
    shutil.copy(path, two)
    tokenizer_from_gguf(one, read_metadata(one))
    tokenizer_from_gguf(two, read_metadata(two))
    before = sorted(p.name for p in folder.iterdir())
    assert len(before) == 2
    st = os.stat(one)
    os.utime(one, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file "changed": a new version
    again = tokenizer_from_gguf(one, read_metadata(one))
    after = sorted(p.name for p in folder.iterdir())
    assert len(after) == 2 and len(set(after) - set(before)) == 1  # one replaced, the other file's kept
    assert again.encode(TEXTS[0]) == [sp.bos_id(), *sp.encode(TEXTS[0])]
    # and at most CACHED_VOCABULARIES entries in all: the least recently used go, a hit counting as a use
    monkeypatch.setattr(tokenizer_module, "CACHED_VOCABULARIES", 2)
    (ones,) = set(after) - set(before)
    (twos,) = set(after) - {ones}
    os.utime(folder / twos, (1e9, 1e9))  # both long unused, two's the longer ...
    os.utime(folder / ones, (1e9 + 10, 1e9 + 10))
    tokenizer_from_gguf(two, read_metadata(two))  # ... but used again now
    three = str(tmp_path / "three.gguf")
    shutil.copy(path, three)
    tokenizer_from_gguf(three, read_metadata(three))
    last = {p.name for p in folder.iterdir()}
    assert len(last) == 2 and twos in last and ones not in last
    # entries of the older forms (a tokenizer's JSON, under either naming) go at the next write;
    # a hit on a cache it cannot touch is a hit
    older = ["e1df8f2ff7e8bfb945fe5160.json", "0123456789abcdef-0123456789abcdef.json"]
    for name in older:
        (folder / name).write_text("{}")
    os.utime(three, ns=(os.stat(three).st_atime_ns, os.stat(three).st_mtime_ns + 10**9))
    tokenizer_from_gguf(three, read_metadata(three))
    assert not any((folder / name).exists() for name in older)

    def read_only(*args, **kwargs):
        raise PermissionError("read-only cache")

    def no_build(*args, **kwargs):
        raise AssertionError("cached merges were derived again")

    monkeypatch.setattr(tokenizer_module.os, "utime", read_only)
    monkeypatch.setattr(tokenizer_module, "_merges_from_scores", no_build)
    hit = tokenizer_from_gguf(three, read_metadata(three))
    assert hit.encode(TEXTS[0]) == [sp.bos_id(), *sp.encode(TEXTS[0])]


def _plain_merges_from_scores(tokens, scores, types):
    """The rule written out: every split of a normal piece into two pieces of the vocabulary,
    ordered by the merged piece's score, then the longer left piece, then the longer right one,
    then the pieces' ids; no merge of a piece with a space (a space never reaches the model)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = [
        (-score, -len(tok[:i]), -len(tok[i:]), vocab[tok[:i]], vocab[tok[i:]], n)
        for n, (tok, score, tt) in enumerate(zip(tokens, scores, types))
        if tt in (1, 4) and " " not in tok
        for i in range(1, len(tok))
        if tok[:i] in vocab and tok[i:] in vocab
    ]
    # ties on score and lengths keep the pieces' order in the file, then the ids
    found.sort(key=lambda m: (m[0], m[1], m[2], m[5], m[3], m[4]))
    return [f"{tokens[m[3]]} {tokens[m[4]]}" for m in found]


def _merge_strings(tokens, ids) -> list[str]:
    """_merges_from_scores's token ids (left and right in turn) as GGUF's "a b" merges."""
    return [f"{tokens[a]} {tokens[b]}" for a, b in zip(ids[0::2], ids[1::2])]


def test_merges_from_scores_follow_the_rule_ties_included():
    from treadle.text.tokenizer import _merges_from_scores

    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "abca", "a b", "<s>", "aa", "aaa", "a ", " b"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -1.0, -2.0, -2.0, -0.5, 0.0, -3.0, -3.0, -0.1, -0.1]
    types = [1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 3, 1, 1, 1, 1]
    expected = _plain_merges_from_scores(tokens, scores, types)
    assert expected[:3] == ["a b", "b c", "c a"] and all(m.count(" ") == 1 for m in expected)
    assert (
        _merge_strings(tokens, _merges_from_scores(tokens, scores, types, {t: i for i, t in enumerate(tokens)}))
        == expected
    )


def test_a_byte_level_merge_of_a_piece_with_a_space_is_left_out(tmp_path):
    """GGUF's merges are "a b" strings; one whose piece holds a space ("x y z") can never apply to
    byte-level text (a space is "Ġ" there), so it does not stop the file from loading."""
    path = str(tmp_path / "bytes.gguf")
    _write_byte_level_gguf(path, ["a", "b", "c", "Ġ", "ab", "abc", "y z"], ["a b", "ab c", "x y z"])
    tok = tokenizer_from_gguf(path, read_metadata(path))
    assert tok.encode("abc ab", add_special_tokens=False) == [5, 3, 4]
    assert tok.decode([5, 3, 4]) == "abc ab"


def test_a_byte_level_vocabulary_with_a_newline_piece_still_loads(tmp_path):
    """A piece may hold a newline (a merges file, one merge per line, could not carry it)."""
    path = str(tmp_path / "newline.gguf")
    _write_byte_level_gguf(path, ["a", "b", "Ġ", "ab", "\n", "a\n"], ["a b", "a \n"])
    tok = tokenizer_from_gguf(path, read_metadata(path))
    assert tok.encode("ab ab", add_special_tokens=False) == [3, 2, 3]


@pytest.mark.parametrize("text", TEXTS)
def test_a_sentencepiece_file_with_its_own_merges_tokenizes_as_sentencepiece_in_the_front_end(spm_gguf, tmp_path, text):
    """Some SentencePiece GGUFs carry tokenizer.ggml.merges beside the scores: the front end's
    tokenizer (load_tokenizer, built after the metadata is let go) is still SentencePiece's."""
    from treadle.model.loading.loader import load_tokenizer
    from treadle.text.tokenizer import _merges_from_scores

    _, sp = spm_gguf
    tokens, scores, types = _vocabulary(sp)
    path = str(tmp_path / "spm-merges.gguf")
    _write_spm_gguf(
        path,
        sp,
        _merge_strings(tokens, _merges_from_scores(tokens, scores, types, {t: i for i, t in enumerate(tokens)})),
    )
    assert load_tokenizer(path).encode(text) == [sp.bos_id()] + sp.encode(text)
