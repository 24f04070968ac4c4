"""Text <-> token ids, and chat templates, for GGUF files and Hugging Face folders.

Both sources end up as one `tokenizers.Tokenizer` plus the few facts the engine needs:
BOS/EOS ids, the stop set (eos + eot/eom, + generation_config's eos list) and the chat template.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading
import time
from array import array
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from treadle.model.config import ModelLoadError
from treadle.utils import release_free_heap

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

# `tokenizers` is imported where a vocabulary is built: an engine core holds a lazy Tokenizer (its
# vocabulary built for a structured-output request only) and need not load the library (~4 MiB)

log = logging.getLogger("treadle")

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words (llama.cpp's "qwen35")
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k's (gpt-oss, GPT-4o; llama.cpp's "gpt-4o"): cased words, numbers in threes, "/" kept after punctuation
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    # SmolLM's own tokenizer.json: every digit alone, then GPT-2's byte-level split.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it.
BPE_PRE_TOKENIZERS = {
    "default": lambda: _split_then_bytes(_GPT2_SPLIT),
    "gpt-2": lambda: _split_then_bytes(_GPT2_SPLIT),
    "olmo": lambda: _split_then_bytes(_GPT2_SPLIT),  # llama.cpp: GPT-2's split (OLMo, OLMoE)
    "smollm": _smollm_pre_tokenizer,
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "qwen35": lambda: _split_then_bytes(_QWEN35_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "gpt-4o": lambda: _split_then_bytes(_GPT4O_SPLIT),
}


# A file without a chat template gets the template of the family whose turn markers its vocabulary
# has. Gemma's is Google's own template (system text joins the first user turn; the assistant's
# role is "model").
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
BUILTIN_TEMPLATES = [(("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE)]
# Control tokens that end a turn in some family's template: a stop wherever the vocabulary has
# them (llama.cpp's end-of-generation set), beside the file's EOS. Harmony (gpt-oss) ends a turn
# with <|return|> or <|call|>; its <|end|> ends a message and the turn goes on, so a vocabulary
# with both of those has no <|end|> stop (as llama.cpp decides).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")


def builtin_template(vocab: set[str]) -> str | None:
    for markers, template in BUILTIN_TEMPLATES:
        if all(m in vocab for m in markers):
            return template
    return None


# Template variables the renderer itself sets (the conversation, the special tokens, the helpers
# every Hugging Face template may call): a caller's extra variables may not replace them.
TEMPLATE_OWNED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)

_SURROGATE = re.compile("[\ud800-\udfff]")


def first_surrogate(text: str) -> int | None:
    """The position of the first lone surrogate in `text` (not valid Unicode), or None."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids, stop set and chat template of one model.

    `backend` may be a function that builds it: then it is built on first use (the engine core
    process, which needs the vocabulary only for a structured-output request, does not hold a
    262K-token one, ~100 MB, for nothing; the front end and `LLM` build it at once)."""

    def __init__(
        self,
        backend: HFTokenizer | Callable[[], HFTokenizer],
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: set[int],
        chat_template: str | None,
        source: str,
    ):
        self._backend = None if callable(backend) else backend
        self._build = None if self._backend is not None else backend
        self._lock = threading.Lock()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(stop_token_ids)
        self.chat_template = chat_template
        self.source = source

    @property
    def backend(self) -> HFTokenizer:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._build()
                    self._build = None
        return self._backend

    @functools.cached_property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    @property
    def bos_token(self) -> str:
        return self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """ValueError for a text that is not valid Unicode (a lone surrogate: a legal JSON escape
        and a legal Python str, but no character; the tokenizer cannot take it)."""
        bad = first_surrogate(text)
        if bad is not None:
            raise ValueError(
                f"the text is not valid Unicode: a lone surrogate (U+{ord(text[bad]):04X}) at position {bad}"
            )
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        """`kwargs`: more template variables; none of the renderer's own (`TEMPLATE_OWNED`)."""
        owned = sorted(TEMPLATE_OWNED & set(kwargs))
        if owned:
            raise ValueError(f"template variable {owned[0]!r} is set by the renderer and cannot be passed")
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"the model {self.source} has no chat template; pass chat_template=")
        context = dict(kwargs)
        context.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        from treadle.text.chat_template import render  # jinja2 (~90 ms to import): not on an engine core's path

        return render(template, context)  # sandboxed and bounded; ValueError if it fails


# ---------------------------------------------------------------- GGUF


# the lists an engine's load reads past (its tokenizer is lazy): the vocabulary's build reads them
UNREAD_AT_LOAD = frozenset({"tokenizer.ggml.merges", "tokenizer.ggml.scores"})
VOCABULARY_LISTS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})  # the load's own reads


def tokenizer_from_gguf(
    path: str, meta: dict, lazy: bool = False, unread: Collection[str] = (), hand_over: bool = False
) -> Tokenizer:
    """Build the tokenizer a GGUF file describes under `tokenizer.ggml.*` (`lazy`: its vocabulary
    when first used; the metadata is checked now either way). `unread`: keys the file has but
    `meta` was read without (UNREAD_AT_LOAD, lazy only): checked when the vocabulary is built.
    `hand_over` (lazy, `meta` whole): the build takes `meta` rather than reading the file again,
    and keeps none of it."""
    if unread and not lazy:
        raise ValueError("a tokenizer of metadata read in part is built lazily")
    if hand_over and (unread or not lazy):
        raise ValueError("only a lazy tokenizer of the whole metadata takes it over")

    def has(key: str) -> bool:
        return meta.get(key) is not None or key in unread

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelLoadError(f"{path}: tokenizer.ggml.model/tokens: missing, the file carries no tokenizer")
    _check_gguf_tokenizer(path, meta)
    token_types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model = {kind!r}: unsupported tokenizer model (supported: 'gpt2', 'llama')"
        )
    # what a lazy build would find first, found now
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in BPE_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.pre = {pre!r}: unsupported pre-tokenizer (supported: {sorted(BPE_PRE_TOKENIZERS)})"
        )
    if kind == "gpt2" and not has("tokenizer.ggml.merges"):
        raise ModelLoadError(f"{path}: tokenizer.ggml.merges: missing, a byte-level BPE vocabulary needs its merges")
    if kind == "llama" and not has("tokenizer.ggml.merges") and not has("tokenizer.ggml.scores"):
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.scores: missing, a SentencePiece vocabulary needs scores or merges"
        )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")

    stop = {
        i
        for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
        if i is not None
    }
    control = {tok: i for i, (tok, tt) in enumerate(zip(tokens, token_types)) if tt == TOKEN_CONTROL}
    stop.update(control[t] for t in END_OF_TURN_TOKENS if t in control)
    if all(t in control for t in HARMONY_TURN_ENDS) and "<|end|>" in control:
        stop.discard(control["<|end|>"])
    template = meta.get("tokenizer.chat_template")
    if template is None:
        template = builtin_template(set(control))
        if template is not None:
            log.info("%s has no chat template: using the built-in one its vocabulary's turn markers name", path)
    derived = kind == "llama" and not has("tokenizer.ggml.merges")  # merges from the scores
    if lazy:  # the metadata read again when needed (holding its lists until then would cost as much)
        held = [meta] if hand_over else []
        del meta
        return Tokenizer(
            lambda: _gguf_backend(path, held, kind, derived),
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=stop,
            chat_template=template,
            source=path,
        )
    return Tokenizer(
        _gguf_backend(path, [meta], kind, derived),
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=stop,
        chat_template=template,
        source=path,
    )


def tokenizer_from_gguf_file(path: str) -> Tokenizer:
    """tokenizer_from_gguf of a file's own metadata, read once and handed to the vocabulary's
    build, which holds none of it afterwards (Gemma 3's lists are ~36 MB)."""
    from treadle.model.loading.gguf_file import read_metadata

    tokenizer = tokenizer_from_gguf(path, read_metadata(path), lazy=True, hand_over=True)
    tokenizer.backend  # noqa: B018 - built now, not on the first request
    return tokenizer


def _gguf_backend(path: str, held: list, kind: str, derived: bool) -> HFTokenizer:
    """The `tokenizers` tokenizer of a GGUF file's (checked) `tokenizer.ggml.*` metadata (`held`:
    [the metadata], taken from the list; [] to read it from the file here) of vocabulary `kind`.

    The BPE model is built from Python's vocabulary and merge pairs, not parsed from a tokenizer
    JSON: `tokenizers` reads a JSON model through a full copy of it (every piece and merge a small
    string of its own), freed in among the tokens it keeps, which leaves a large vocabulary's
    (Gemma 3's 262K tokens) resident set well above what it uses; built so, close to it.
    `derived`: the merges come from the scores, which takes a second for a large vocabulary: they
    are kept per file (_cached_merges)."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    from treadle.model.loading.gguf_file import read_metadata

    if held:
        meta = held.pop()
    else:
        meta = read_metadata(path)
        _check_gguf_tokenizer(path, meta)  # (the lists the engine's load left unread)
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    vocab = dict(zip(tokens, range(len(tokens))))  # (a repeated piece: its last id, as a comprehension's)
    if derived:
        scores = meta.pop("tokenizer.ggml.scores")
        pairs = _cached_merges(path, tokens, functools.partial(_merges_from_scores, tokens, scores, token_types, vocab))
        del scores
    else:
        pairs = _merge_pairs(path, meta.pop("tokenizer.ggml.merges"))
    meta.pop("tokenizer.ggml.scores", None)
    try:
        if kind == "gpt2":
            backend = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=False))
        else:  # llama.cpp's SPM vocabulary: BPE whose merge order is the merged piece's score, with byte fallback
            unk_id = meta.get("tokenizer.ggml.unknown_token_id")
            unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
            # (no word cache: _drop_whole_text_cache)
            backend = HFTokenizer(
                models.BPE(
                    vocab,
                    pairs,
                    unk_token=unk,
                    fuse_unk=True,
                    byte_fallback=True,
                    ignore_merges=False,
                    cache_capacity=0,
                )
            )
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown pieces
        raise ModelLoadError(f"{path}: tokenizer.ggml.merges: {e}") from None
    del vocab, pairs
    if kind == "gpt2":
        backend.pre_tokenizer = BPE_PRE_TOKENIZERS[
            meta.get("tokenizer.ggml.pre", "default")
        ]()  # checked by tokenizer_from_gguf
        backend.decoder = decoders.ByteLevel()
    else:
        _sentencepiece_pipeline(backend, meta.get("tokenizer.ggml.add_space_prefix", True))
    # control tokens as special ones, then user-defined ones, each matched in the raw text
    added = [i for i, tt in enumerate(token_types) if tt == TOKEN_CONTROL or tt == TOKEN_USER_DEFINED]
    for special, kind_of in ((True, TOKEN_CONTROL), (False, TOKEN_USER_DEFINED)):
        chosen = [AddedToken(tokens[i], special=special, normalized=False) for i in added if token_types[i] == kind_of]
        (backend.add_special_tokens if special else backend.add_tokens)(chosen)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    _set_post_processor(backend, tokens, bos if add_bos else None, eos if add_eos else None)
    del meta, tokens, token_types
    release_free_heap()  # the build's freed temporaries
    return backend


CACHED_VOCABULARIES = 32  # entries _cached_merges keeps (files moved or deleted leave theirs)
_ENTRY = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}\.merges")
_MERGES_MAGIC = b"treadle merges 1\n"  # then the merges' token ids, left and right, int32 little-endian


def _cached_merges(path: str, tokens: list[str], derive: Callable[[], array]) -> list[tuple[str, str]]:
    """The merges `derive()` gives (token ids, left and right in turn) as pairs of `tokens`, kept under
    ~/.cache/treadle/tokenizers as `<path key>-<version key>.merges`: the file's absolute path,
    then its size and modification time and this module's source. One entry per path: writing
    one removes that path's older versions (and entries of an older form), and the least recently
    used beyond CACHED_VOCABULARIES (a hit touches its entry). An entry that is not whole, or names
    a token the vocabulary lacks, is derived again; any failure to read or write the cache only
    costs the derivation."""
    import hashlib
    import sys

    from treadle.utils import cache_root

    cached = None
    try:
        st = os.stat(path)
        with open(__file__, "rb") as f:
            source = hashlib.sha256(f.read()).hexdigest()
        where = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
        version = hashlib.sha256(f"{st.st_size}|{st.st_mtime_ns}|{source}".encode()).hexdigest()[:16]
        cached = os.path.join(cache_root(), "tokenizers", f"{where}-{version}.merges")
        if os.path.exists(cached):
            with open(cached, "rb") as f:
                data = f.read()
            ids = array("I")  # (unsigned: an id past the vocabulary fails the lookup, none is negative)
            if not data.startswith(_MERGES_MAGIC) or (len(data) - len(_MERGES_MAGIC)) % 8:
                raise ValueError("not a whole merges entry")
            ids.frombytes(data[len(_MERGES_MAGIC) :])
            del data
            if sys.byteorder != "little":
                ids.byteswap()
            pairs = _pairs(tokens, ids)  # IndexError: a merge names a token the vocabulary lacks
            try:
                os.utime(cached)  # used now: the last to be let go
            except OSError:  # a read-only cache is still a cache
                pass
            return pairs
    except Exception as e:  # noqa: BLE001 - a cache that cannot be read is rebuilt (and rewritten)
        log.debug("tokenizer cache unreadable (%s): deriving the merges", e)
    ids = derive()
    if cached is not None:
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = f"{cached}.{os.getpid()}.tmp"
            out = array("i", ids)
            if sys.byteorder != "little":
                out.byteswap()
            with open(tmp, "wb") as f:
                f.write(_MERGES_MAGIC)
                out.tofile(f)
            os.replace(tmp, cached)
        except OSError as e:
            log.debug("tokenizer cache not written (%s)", e)
        else:
            _prune_cache(cached, f"{where}-")
    return _pairs(tokens, ids)


def _pairs(tokens: list[str], ids) -> list[tuple[str, str]]:
    """Token ids, left and right in turn, as pairs of their pieces."""
    piece = tokens.__getitem__
    return list(zip(map(piece, ids[0::2]), map(piece, ids[1::2])))


def _prune_cache(kept: str, same_path: str) -> None:
    """Remove the cache's entries of the same path as `kept` but it, entries of an older naming, a
    cut-short write's `.tmp` over an hour old, then the least recently used beyond
    CACHED_VOCABULARIES (another process's pruning may have gone first: nothing is lost)."""
    folder, name = os.path.split(kept)

    def used(entry: str) -> float:
        try:
            return os.path.getmtime(entry)
        except OSError:
            return float("inf")  # gone meanwhile

    try:
        names = os.listdir(folder)
    except OSError:
        return
    others = [os.path.join(folder, n) for n in names if n.endswith((".merges", ".json")) and n != name]
    # a write cut short leaves its `.tmp`: gone once it cannot be a write still under way
    others += [
        p for p in (os.path.join(folder, n) for n in names if n.endswith(".tmp")) if used(p) < time.time() - 3600
    ]
    # this path's older versions, and entries of an older form (a whole tokenizer's JSON, or named
    # before `<path>-<version>`)
    stale = [
        p for p in others if os.path.basename(p).startswith(same_path) or not _ENTRY.fullmatch(os.path.basename(p))
    ]
    rest = sorted((p for p in others if p not in stale), key=used)
    for entry in stale + rest[: max(0, len(rest) + 1 - CACHED_VOCABULARIES)]:
        try:
            os.remove(entry)
        except OSError:
            pass


def _check_gguf_tokenizer(path: str, meta: dict) -> None:
    """The tokenizer.ggml.* values have the types and lengths the format gives them."""

    def fail(key: str, expected: str):
        value = meta[key]
        shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:80]
        raise ModelLoadError(f"{path}: tokenizer.ggml.{key.rsplit('.', 1)[1]} = {shown}: expected {expected}")

    # the lists' element types taken as a set (a 151K-token vocabulary's checks: ~0.1 s one by
    # one); the reader makes plain str / int / float / bool values, so exact types suffice
    tokens = meta["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not tokens or not set(map(type, tokens)) <= {str}:
        fail("tokenizer.ggml.tokens", "a non-empty list of strings")
    n = len(tokens)
    lists = {"tokenizer.ggml.token_type": {int}, "tokenizer.ggml.scores": {int, float}, "tokenizer.ggml.merges": {str}}
    for key, kinds in lists.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, list) or not set(map(type, value)) <= kinds):
            fail(key, f"a list of {'strings' if kinds == {str} else 'numbers'}")
        if value is not None and key != "tokenizer.ggml.merges" and len(value) != n:
            fail(key, f"one entry per token ({n})")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if key in meta and not isinstance(meta[key], str):
            fail(key, "a string")
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id", "padding_token_id"):
        value = meta.get("tokenizer.ggml." + key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            fail("tokenizer.ggml." + key, "a token id")
        if value is not None and not 0 <= value < n:  # as llama.cpp: a warning, and the id is not used
            log.warning(
                "%s: tokenizer.ggml.%s = %d is not a token of the vocabulary (%d tokens); ignored", path, key, value, n
            )
            del meta["tokenizer.ggml." + key]
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        value = meta.get("tokenizer.ggml." + key)
        if value is not None and not isinstance(value, (bool, int)):
            fail("tokenizer.ggml." + key, "a boolean")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{path}: tokenizer.chat_template: expected a template string")


def _merge_pairs(path: str, merges: list[str]) -> list[tuple[str, str]]:
    """GGUF's merges ("a b") as pairs. A merge with a piece that holds a space is left out: no
    vocabulary kind here lets a space reach the model (byte-level BPE maps it to "Ġ", SentencePiece
    to "▁"), so it can never apply."""
    for m in merges:
        if " " not in m:
            raise ModelLoadError(f"{path}: tokenizer.ggml.merges: {m!r}: expected two pieces separated by a space")
    return [tuple(m.split(" ")) for m in merges if m.count(" ") == 1]


def _drop_whole_text_cache(backend: HFTokenizer) -> None:
    """No BPE word cache where the pipeline does not split text into words (no pre-tokenizer, or a
    Metaspace that does not split: SentencePiece's vocabularies; a GGUF file's is built without one).
    `tokenizers` caches each word under 256 bytes it encodes, up to 10,000, and a cached word keeps a
    32-byte slot per byte of it: where the word is a whole message, the cache grew Gemma 3's front
    end by 57 MiB over 12,000 short prompts, for hits that save ~15 us on a repeated one.
    Word-splitting vocabularies (byte-level BPE: a word is a few bytes) keep theirs."""
    from tokenizers import models, pre_tokenizers

    model, pre = backend.model, backend.pre_tokenizer
    whole = pre is None or (isinstance(pre, pre_tokenizers.Metaspace) and not pre.split)
    resize = getattr(model, "_resize_cache", None)  # (tokenizers' own name for it, not its public API)
    if whole and isinstance(model, models.BPE) and resize is not None:
        resize(0)


def _sentencepiece_pipeline(backend: HFTokenizer, add_prefix: bool) -> None:
    # As SentencePiece and llama.cpp: a space is prepended to every text fragment (the start, and
    # after each special token) even when it already starts with spaces. (tokenizers' Metaspace
    # skips the prefix on text that starts with a space, so it is not used here.)
    from tokenizers import decoders, normalizers

    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def _merges_from_scores(tokens, scores, token_types, vocab: dict[str, int]) -> array:
    """Every split of a normal piece into two pieces of `vocab` (piece -> id), best merged score first
    (then the longer left piece, the longer right one, then the vocabulary's order; a NaN score
    as the lowest): the merges' token ids, left and right in turn.

    Written without numpy: the front end derives them on a file's first start, and numpy's import
    (~15 MiB) stayed in its resident set for the server's life. The pieces are put in order by
    score once; only pieces of equal score have their splits sorted together."""
    get = vocab.get

    def splits(n: int):
        """(left length, left id, right id) of piece n's splits, the longer left piece first."""
        tok = tokens[n]
        if (
            len(tok) < 2 or token_types[n] not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or " " in tok
        ):  # a space: never reached (_merge_pairs)
            return
        for i in range(len(tok) - 1, 0, -1):
            a = get(tok[:i])
            if a is not None:
                b = get(tok[i:])
                if b is not None:
                    yield i, a, b

    if any(s != s for s in scores):
        scores = [s if s == s else -math.inf for s in scores]
    order = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)  # (stable: ties keep the file's order)
    out = array("i")
    start = 0
    while start < len(order):
        score, end = scores[order[start]], start + 1
        while end < len(order) and scores[order[end]] == score:
            end += 1
        if end - start == 1:
            for _, a, b in splits(order[start]):
                out.extend((a, b))
        else:  # pieces of one score: their splits by left length, right length, then the pieces' order
            tied = sorted((-i, i - len(tokens[n]), n, a, b) for n in order[start:end] for i, a, b in splits(n))
            for *_, a, b in tied:
                out.extend((a, b))
        start = end
    return out


def _set_post_processor(backend: HFTokenizer, tokens, bos: int | None, eos: int | None) -> None:
    if bos is None and eos is None:
        return
    from tokenizers import processors

    head = [f"{tokens[bos]}:0"] if bos is not None else []
    tail = [f"{tokens[eos]}:0"] if eos is not None else []
    special = [(tokens[i], i) for i in {bos, eos} if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(head + ["$A:0"] + tail),
        pair=" ".join(head + ["$A:0"] + tail + head + ["$B:1"] + tail),
        special_tokens=special,
    )


# ---------------------------------------------------------------- Hugging Face folder


def read_json(path: str) -> dict:
    """A JSON file as a dict ({} if it is absent); unreadable: a ModelLoadError naming it."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: cannot read: {type(e).__name__}: {e}") from e


def tokenizer_from_hf_folder(folder: str, config: dict) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: tokenizer.json: missing (treadle reads fast-tokenizer files only)")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ModelLoadError(f"{path}: cannot parse: {e}") from e
    _drop_whole_text_cache(backend)
    tok_config = read_json(os.path.join(folder, "tokenizer_config.json"))
    gen_config = read_json(os.path.join(folder, "generation_config.json"))
    for name, value in (("tokenizer_config.json", tok_config), ("generation_config.json", gen_config)):
        if not isinstance(value, dict):
            raise ModelLoadError(f"{folder}/{name}: expected a JSON object, found {type(value).__name__}")

    def token_id(entry) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return backend.token_to_id(entry) if isinstance(entry, str) else None

    bos = token_id(tok_config.get("bos_token"))
    if bos is None:
        bos = _first_id(f"{folder}/config.json: bos_token_id", config.get("bos_token_id"))
    eos = token_id(tok_config.get("eos_token"))
    if eos is None:
        eos = _first_id(f"{folder}/config.json: eos_token_id", config.get("eos_token_id"))
    stop = {eos} if eos is not None else set()
    for where, source in (
        ("generation_config.json", gen_config.get("eos_token_id")),
        ("config.json", config.get("eos_token_id")),
    ):
        stop.update(_as_list(f"{folder}/{where}: eos_token_id", source))

    chat_template = tok_config.get("chat_template")
    if isinstance(chat_template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if chat_template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            chat_template = f.read()
    if chat_template is None:
        extra = read_json(os.path.join(folder, "chat_template.json"))
        chat_template = extra.get("chat_template") if isinstance(extra, dict) else None
    if chat_template is not None and not isinstance(chat_template, str):
        raise ModelLoadError(
            f"{folder}/tokenizer_config.json: chat_template = {type(chat_template).__name__}: "
            "expected a template string"
        )
    release_free_heap()
    return Tokenizer(
        backend, bos_token_id=bos, eos_token_id=eos, stop_token_ids=stop, chat_template=chat_template, source=folder
    )


def _as_list(where: str, value) -> list[int]:
    """Token ids from a config value: an id, a list of ids, or null."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 1 << 31:
            raise ModelLoadError(f"{where} = {value!r}: expected a token id or a list of token ids")
    return ids


def _first_id(where: str, value) -> int | None:
    ids = _as_list(where, value)
    return ids[0] if ids else None
