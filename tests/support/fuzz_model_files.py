"""Fuzzing model files: a small valid GGUF file and a small valid HF folder, mutated by Hypothesis.

Every mutated model is loaded in a worker process with bounded memory (its address space may grow
by the file's size + 1 GiB, no more) and a 10 s limit per example. A load must either work, and
then answer a 1-token request, or raise `ModelLoadError`; anything else fails the run: another
exception, a crash (the worker dies), a hang (no answer within the limit), or an oversized
allocation (a MemoryError under the memory bound).

The suite runs a few hundred examples per format (tests/model/loading/test_loader.py); the long run is

    python -m tests.support.fuzz_model_files --examples 2000            # both formats, a random seed
    python -m tests.support.fuzz_model_files --format gguf --examples 5000 --seed 7
"""

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import struct
import tempfile
import time
import traceback
from dataclasses import dataclass

import numpy as np

EXAMPLE_SECONDS = 10.0
MEMORY_MARGIN = 1 << 30

# ---------------------------------------------------------------- the valid seeds


def write_seed_gguf(path: str, override: tuple | None = None) -> None:
    """A one-layer Llama (hidden 32, two heads, one KV head) in float32 with a byte-level BPE
    vocabulary, its merges, ChatML specials and a chat template: every section a loader reads.
    override: (key, GGUFValueType or None, value, element type): one metadata entry replaced,
    added, or (type None) removed."""
    import gguf

    from tests.support.tiny_models import CHATML, SPECIALS, tiny_tokenizer

    tok = tiny_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if not isinstance(m, str) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    hidden, heads, kv_heads, ff, n_vocab = 32, 2, 1, 48, len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    if override is not None:
        key, vtype, value, sub_type = override
        w.kv_data[0].pop(key, None)
        if vtype is not None:
            w.kv_data[0][key] = gguf.GGUFValue(value=value, type=vtype, sub_type=sub_type)
    rng = np.random.default_rng(0)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", t(n_vocab, hidden))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_q.weight", t(heads * head_dim, hidden))
    w.add_tensor("blk.0.attn_k.weight", t(kv_heads * head_dim, hidden))
    w.add_tensor("blk.0.attn_v.weight", t(kv_heads * head_dim, hidden))
    w.add_tensor("blk.0.attn_output.weight", t(hidden, heads * head_dim))
    w.add_tensor("blk.0.ffn_gate.weight", t(ff, hidden))
    w.add_tensor("blk.0.ffn_up.weight", t(ff, hidden))
    w.add_tensor("blk.0.ffn_down.weight", t(hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_seed_hf(folder: str) -> None:
    """The same model as an HF folder: config.json, model.safetensors, tokenizer files."""
    from safetensors.numpy import save_file

    from tests.support.tiny_models import CHATML, tiny_tokenizer

    tok = tiny_tokenizer()
    n_vocab, hidden, heads, kv_heads, ff = tok.get_vocab_size(), 32, 2, 1, 48
    head_dim = hidden // heads
    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": n_vocab, "hidden_size": hidden,
        "intermediate_size": ff, "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "eos_token_id": n_vocab - 1, "torch_dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(0)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": t(n_vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": t(n_vocab, hidden),
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        p + "self_attn.q_proj.weight": t(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": t(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": t(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": t(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": t(ff, hidden),
        p + "mlp.up_proj.weight": t(ff, hidden),
        p + "mlp.down_proj.weight": t(hidden, ff),
    }
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)


# ---------------------------------------------------------------- where the fields are


@dataclass(frozen=True)
class Field:
    """One numeric field of a file: its offset, struct format and what it is."""

    offset: int
    fmt: str
    what: str


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_fields(data: bytes) -> tuple[list[Field], int]:
    """Every count, length, type, dimension, offset and scalar value of a valid GGUF file's header,
    and where the header ends. (An independent walk of the layout, not the loader's parser.)"""
    fields, pos = [Field(4, "<I", "version"), Field(8, "<Q", "tensor count"), Field(16, "<Q", "kv count")], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(what):
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        fields.append(Field(pos, "<Q", f"{what} length"))
        pos += 8 + n

    def value(vtype, what):
        nonlocal pos
        if vtype in _GGUF_SCALARS:
            fields.append(Field(pos, _GGUF_SCALARS[vtype], what))
            pos += struct.calcsize(_GGUF_SCALARS[vtype])
        elif vtype == 8:
            string(what)
        else:
            etype, count = struct.unpack_from("<IQ", data, pos)
            fields.extend([Field(pos, "<I", f"{what} element type"), Field(pos + 4, "<Q", f"{what} count")])
            pos += 12
            for i in range(count):
                if i < 3 or etype == 8 and i % 97 == 0:  # the first elements, and some strings' lengths
                    value(etype, f"{what}[{i}]")
                elif etype in _GGUF_SCALARS:
                    pos += struct.calcsize(_GGUF_SCALARS[etype])
                else:
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    for _ in range(n_kv):
        key_at = pos
        string("key")
        key = data[key_at + 8 : pos].decode()
        fields.append(Field(pos, "<I", f"{key} type"))
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        value(vtype, key)
    for _ in range(n_tensors):
        name_at = pos
        string("tensor name")
        name = data[name_at + 8 : pos].decode()
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append(Field(pos, "<I", f"{name} n_dims"))
        pos += 4
        for d in range(n_dims):
            fields.append(Field(pos, "<Q", f"{name} dim {d}"))
            pos += 8
        fields.extend([Field(pos, "<I", f"{name} type"), Field(pos + 4, "<Q", f"{name} offset")])
        pos += 12
    return fields, pos


def safetensors_header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack_from("<Q", data, 0)[0]
    return n, json.loads(data[8 : 8 + n])


# ---------------------------------------------------------------- mutations (Hypothesis strategies)

INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    4096,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**48,
    2**60,
    2**63 - 1,
    2**63,
    2**64 - 1,
]
FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("inf"), float("-inf"), float("nan")]


def _number_for(st, fmt: str, original):
    """A new value for a field of struct format `fmt`: an interesting one, or near the original."""
    kind = fmt[-1]
    if kind in "fd":
        return st.sampled_from(FLOATS) | st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == "f" else 64)
    if kind == "?":
        return st.integers(0, 255)
    bits = struct.calcsize(fmt) * 8
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if kind.islower() else (0, 2**bits - 1)
    near = st.integers(-3, 3).map(lambda d: original + d)
    candidates = st.sampled_from(INTERESTING + [-1, -2, -(2**31)]) | near | st.integers(lo, hi)
    return candidates.map(lambda v: min(max(v, lo), hi))


def gguf_mutation(st, seed: bytes):
    """A strategy for mutated copies of the seed GGUF: header fields set to other values, bytes of
    the header overwritten, or the file cut short; one to three of them."""
    fields, header_end = gguf_fields(seed)

    @st.composite
    def one(draw, data: bytearray):
        kind = draw(st.sampled_from(["field", "field", "field", "bytes", "truncate"]))
        if kind == "field":
            f = draw(st.sampled_from(fields))
            original = (
                struct.unpack_from(f.fmt, data, f.offset)[0] if f.offset + struct.calcsize(f.fmt) <= len(data) else 0
            )
            value = draw(_number_for(st, f.fmt, original))
            if f.offset + struct.calcsize(f.fmt) <= len(data):
                struct.pack_into(f.fmt, data, f.offset, value)
            return f"{f.what} = {value!r}"
        if len(data) < 2:
            return "nothing (the file is empty already)"
        if kind == "bytes":
            at = draw(st.integers(0, min(header_end, len(data)) - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at : at + len(chunk)] = chunk
            return f"bytes at {at} = {chunk.hex()}"
        cut = draw(st.integers(0, len(data) - 1))
        del data[cut:]
        return f"truncated at {cut}"

    @st.composite
    def mutated(draw):
        data = bytearray(seed)
        steps = [draw(one(data)) for _ in range(draw(st.integers(1, 3)))]
        return bytes(data), steps

    return mutated()


# keys a llama GGUF may carry besides the seed's, so that their checks are reached too
EXTRA_GGUF_KEYS = [
    "general.alignment", "llama.attention.key_length", "llama.attention.value_length", "llama.attention.sliding_window",
    "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.expert_count", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.scores", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_space_prefix",
]  # fmt: skip


def gguf_metadata_mutation(st, keys: list[str], token_count: int):
    """A strategy for (key, value type, value, element type) overrides of one metadata entry: a
    value of another type, an extreme number, a short or wrong-typed list, or the entry removed."""
    import gguf

    T = gguf.GGUFValueType
    ints = st.sampled_from(INTERESTING).map(int)
    scalar = st.one_of(
        st.tuples(st.sampled_from([T.UINT8, T.UINT16, T.UINT32, T.UINT64]), ints),
        st.tuples(st.sampled_from([T.INT32, T.INT64]), st.sampled_from([-1, -(2**31), 0, 1, 2**31 - 1])),
        st.tuples(st.just(T.FLOAT32), st.sampled_from(FLOATS)),
        st.tuples(st.just(T.BOOL), st.booleans()),
        st.tuples(st.just(T.STRING), st.sampled_from(["", "none", "linear", "llama", "gpt2", "\x00", "ÿ" * 40])),
    )
    lists = st.one_of(
        st.tuples(st.just(T.INT32), st.lists(st.integers(-2, token_count + 2), min_size=1, max_size=token_count + 2)),
        st.tuples(
            st.just(T.STRING),
            st.lists(st.sampled_from(["", "a", "a b", "Ġ t", "<|im_end|>", "x y z"]), min_size=1, max_size=8),
        ),
        st.tuples(st.just(T.FLOAT32), st.lists(st.sampled_from(FLOATS), min_size=1, max_size=8)),
    )
    entry = st.one_of(
        scalar.map(lambda tv: (tv[0], tv[1], None)),
        lists.map(lambda tv: (T.ARRAY, tv[1], tv[0])),
        st.just((None, None, None)),
    )
    return st.tuples(st.sampled_from(keys + EXTRA_GGUF_KEYS), entry).map(lambda kv: (kv[0], *kv[1]))


def _json_values(st):
    scalars = (
        st.none()
        | st.booleans()
        | st.sampled_from(INTERESTING + [-1, -(2**63)]).map(int)
        | st.sampled_from(FLOATS[:7])
        | st.text(max_size=12)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=6,
    )


def hf_mutation(st, folder: str):
    """A strategy for mutated copies of the seed HF folder: config.json values replaced, removed or
    added; the safetensors header's length, dtypes, shapes and offsets changed, its bytes
    overwritten, or the file cut short."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        weights = f.read()
    header_len, header = safetensors_header(weights)
    names = sorted(k for k in header if k != "__metadata__")
    values = _json_values(st)

    @st.composite
    def mutated(draw):
        cfg, hdr, steps = json.loads(json.dumps(config)), json.loads(json.dumps(header)), []
        cut = new_len = None
        body_edits = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(
                st.sampled_from(
                    ["config", "config", "config_drop", "dtype", "shape", "offsets", "header_len", "bytes", "truncate"]
                )
            )
            if kind == "config":
                key = draw(
                    st.sampled_from(sorted(cfg) + ["head_dim", "rope_scaling", "sliding_window", "quantization_config"])
                )
                cfg[key] = draw(values | _number_for(st, "<q", cfg.get(key) if isinstance(cfg.get(key), int) else 0))
                steps.append(f"config {key} = {cfg[key]!r}")
            elif kind == "config_drop" and cfg:
                key = draw(st.sampled_from(sorted(cfg)))
                del cfg[key]
                steps.append(f"config drops {key}")
            elif kind == "dtype":
                name = draw(st.sampled_from(names))
                hdr[name]["dtype"] = draw(
                    st.sampled_from(["F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "XX", ""]) | values
                )
                steps.append(f"{name} dtype = {hdr[name]['dtype']!r}")
            elif kind == "shape":
                name = draw(st.sampled_from(names))
                hdr[name]["shape"] = draw(st.lists(_number_for(st, "<q", 32), max_size=4) | values)
                steps.append(f"{name} shape = {hdr[name]['shape']!r}")
            elif kind == "offsets":
                name = draw(st.sampled_from(names))
                hdr[name]["data_offsets"] = draw(st.lists(_number_for(st, "<q", 0), min_size=0, max_size=3) | values)
                steps.append(f"{name} data_offsets = {hdr[name]['data_offsets']!r}")
            elif kind == "header_len":
                new_len = draw(_number_for(st, "<Q", header_len))
                steps.append(f"header length = {new_len}")
            elif kind == "bytes":
                at = draw(st.integers(0, header_len + 7))
                chunk = draw(st.binary(min_size=1, max_size=8))
                body_edits.append((at, chunk))
                steps.append(f"safetensors bytes at {at} = {chunk.hex()}")
            else:
                cut = draw(st.integers(0, len(weights) - 1))
                steps.append(f"safetensors truncated at {cut}")
        text = json.dumps(hdr, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        data = bytearray(
            struct.pack("<Q", len(text) if new_len is None else new_len) + text + weights[8 + header_len :]
        )
        for at, chunk in body_edits:
            data[at : at + len(chunk)] = chunk
        if cut is not None:
            del data[cut:]
        return json.dumps(cfg), bytes(data), steps

    return mutated()


# ---------------------------------------------------------------- the worker


def _worker(conn) -> None:
    """Load what the parent names, one at a time, under a memory bound; answer what happened."""
    import torch

    from treadle import LLM, SamplingParams
    from treadle.model.config import ModelLoadError

    torch.set_num_threads(1)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    while True:
        job = conn.recv()
        if job is None:
            return
        path, size = job
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        resource.setrlimit(
            resource.RLIMIT_AS, (min(_address_space() + size + MEMORY_MARGIN, hard if hard > 0 else 1 << 62), hard)
        )
        try:
            llm = LLM(path, dtype="float32", num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=64, seed=0)
            out = llm.generate([[1]], SamplingParams(max_tokens=1, temperature=0))
            tokens = out[0].outputs[0].token_ids
            result = (
                ("ok", f"{len(tokens)} token(s)")
                if len(tokens) == 1
                else ("error", f"answered {len(tokens)} tokens to a 1-token request")
            )
            del llm
        except ModelLoadError as e:
            result = ("load_error", str(e))
        except MemoryError:
            result = ("error", "oversized allocation (MemoryError under the memory bound):\n" + traceback.format_exc())
        except BaseException as e:  # noqa: BLE001 - every other failure is what the fuzzer looks for
            result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        conn.send(result)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


class Loader:
    """The parent's side: `load(path)` -> (outcome, detail), outcome one of ok, load_error, error,
    crash, hang. A crashed or hung worker is replaced."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self.crashes = 0

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker, args=(child,), daemon=True)
        self._proc.start()

    def load(self, path: str, timeout: float = EXAMPLE_SECONDS) -> tuple[str, str]:
        if self._proc is None or not self._proc.is_alive():
            self._start()
            timeout += 60  # the worker imports torch first
        size = (
            sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
            if os.path.isdir(path)
            else os.path.getsize(path)
        )
        self._conn.send((path, size))
        if self._conn.poll(timeout):
            try:
                return self._conn.recv()
            except EOFError:
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
            self._proc = None
            return "hang", f"no answer within {timeout:.0f} s"
        code = self._proc.exitcode
        self._proc = None
        return "crash", f"the worker died (exit code {code})"

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


# ---------------------------------------------------------------- campaigns


def run(fmt: str, examples: int, seed: int | None, loader: Loader, workdir: str, derandomize: bool = False) -> dict:
    """Fuzz one format; returns counts per outcome and the failures (their mutation steps)."""
    from hypothesis import HealthCheck, given, reject, settings
    from hypothesis import strategies as st

    counts: dict[str, int] = {}
    failures: list[tuple[list[str], str, str]] = []
    messages: dict[str, int] = {}  # load errors, the file's path taken out
    if fmt == "gguf":
        seed_path = os.path.join(workdir, "seed.gguf")
        write_seed_gguf(seed_path)
        with open(seed_path, "rb") as f:
            seed_bytes = f.read()
        from treadle.model.loading.gguf_file import read_metadata

        meta = read_metadata(seed_path)
        overrides = gguf_metadata_mutation(st, sorted(meta), len(meta["tokenizer.ggml.tokens"]))
        strategy = st.one_of(
            gguf_mutation(st, seed_bytes),
            overrides.map(lambda o: (o, [f"metadata {o[0]} = {o[1] and o[1].name} {o[2]!r:.80}"])),
        )
    else:
        seed_dir = os.path.join(workdir, "seed-hf")
        write_seed_hf(seed_dir)
        strategy = hf_mutation(st, seed_dir)

    def attempt(example) -> None:
        if fmt == "gguf":
            data, steps = example
            path = os.path.join(workdir, "mutant.gguf")
            if isinstance(data, tuple):  # a metadata override: the seed written again with it
                try:
                    write_seed_gguf(path, data)
                except (struct.error, ValueError, OverflowError, TypeError):
                    reject()  # a value its type cannot hold: the writer refuses it, no file to load
            else:
                with open(path, "wb") as f:
                    f.write(data)
        else:
            config, weights, steps = example
            path = os.path.join(workdir, "mutant-hf")
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(seed_dir, path)
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write(config)
            with open(os.path.join(path, "model.safetensors"), "wb") as f:
                f.write(weights)
        outcome, detail = loader.load(path)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "load_error":
            text = detail.replace(path, "<model>")
            messages[text] = messages.get(text, 0) + 1
        if outcome not in ("ok", "load_error"):
            failures.append((steps, outcome, detail))

    test = settings(
        max_examples=examples, deadline=None, database=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck), print_blob=False,
    )(given(strategy)(attempt))  # fmt: skip
    if seed is not None and not derandomize:
        from hypothesis import seed as hypothesis_seed

        test = hypothesis_seed(seed)(test)
    test()
    return {"counts": counts, "failures": failures, "messages": messages}


def main() -> int:
    parser = argparse.ArgumentParser(description="Fuzz treadle's GGUF and HF loaders with mutated model files.")
    parser.add_argument("--format", choices=["gguf", "hf", "both"], default="both")
    parser.add_argument("--examples", type=int, default=2000, help="examples per format (default: 2000)")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    parser.add_argument("--show-errors", type=int, default=0, metavar="N", help="print the N most frequent load errors")
    args = parser.parse_args()
    loader = Loader()
    status = 0
    try:
        for fmt in ("gguf", "hf") if args.format == "both" else (args.format,):
            with tempfile.TemporaryDirectory() as workdir:
                start = time.monotonic()
                result = run(fmt, args.examples, args.seed, loader, workdir)
            print(f"{fmt}: {args.examples} examples in {time.monotonic() - start:.0f} s: {result['counts']}")
            for text, n in sorted(result["messages"].items(), key=lambda kv: -kv[1])[: args.show_errors]:
                print(f"  {n:5d} x {text[:160]}")
            for steps, outcome, detail in result["failures"]:
                status = 1
                print(
                    f"  {outcome}: {'; '.join(steps)}\n    {detail.strip().splitlines()[-1] if detail.strip() else ''}"
                )
    finally:
        loader.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
