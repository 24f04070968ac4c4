"""Benchmark workloads with exact token lengths: random, prefix_repetition, sharegpt; editing
(real code to rewrite, for speculative decoding); multiturn; rerank (a query and its documents).

Prompts are built from token ids of the served model's tokenizer, then decoded and re-encoded until
the text is exactly the asked number of tokens, so that the server sees the length we report.
Each seed gives fresh prompts (a sweep changes the seed per level), so a prefix cache cannot
flatter a figure with prompts it has already seen.
"""

import json
import random
from dataclasses import dataclass
from typing import Protocol

# Text used to learn a server's token ids when only its /tokenize is available.
_SAMPLE_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, "
    "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
    "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
    "explanation, and prediction of real-world phenomena. Mathematics, music, cooking, travel, weather, "
    "gardens, rivers, mountains, computers, languages, markets, cities, stories and games all appear in "
    "ordinary writing; numbers such as 1, 2, 3, 42, 1999 and 2025 do too. Quick brown foxes jump over lazy "
    "dogs while engineers measure latency, throughput, memory and energy in careful experiments."
)


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def sample_ids(self) -> list[int]: ...


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens of the prompt (content tokens for chat)
    output_len: int
    schema: dict | None = None  # a JSON schema to constrain the output to (bench serve --structured-output-ratio)
    conversation: int | None = None  # multiturn: which conversation, its turn, and its system prompt
    turn: int = 0
    system: str | None = None
    system_len: int = 0
    messages: list[dict] | None = None  # multiturn: the whole conversation sent (set as the run goes)
    documents: list[str] | None = None  # rerank: the documents scored against the prompt (the query)


class EngineTokenizer:
    """treadle's Tokenizer seen as a benchmark tokenizer (no special tokens added or sampled)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def sample_ids(self) -> list[int]:
        special = set(self.tok.special_token_ids) | set(self.tok.stop_token_ids)
        return [i for i in range(self.tok.vocab_size) if i not in special]


class LocalTokenizer(EngineTokenizer):
    """A GGUF file's or HF folder's tokenizer, without loading weights."""

    def __init__(self, path: str):
        from treadle.model.loading.loader import load_tokenizer

        super().__init__(load_tokenizer(path))


class ServerTokenizer:
    """A server's /tokenize and /detokenize (vLLM's or llama.cpp's shape)."""

    def __init__(self, base_url: str, headers: dict | None = None):
        import httpx

        self.client = httpx.Client(base_url=base_url, headers=headers or {}, timeout=60)

    def encode(self, text: str) -> list[int]:
        r = self.client.post("/tokenize", json={"content": text, "add_special": False})
        r.raise_for_status()
        return [t["id"] if isinstance(t, dict) else t for t in r.json()["tokens"]]

    def decode(self, ids: list[int]) -> str:
        r = self.client.post("/detokenize", json={"tokens": ids})
        r.raise_for_status()
        body = r.json()
        return body.get("content", body.get("prompt", ""))

    def sample_ids(self) -> list[int]:
        return sorted(set(self.encode(_SAMPLE_TEXT)))


def exact_text(tok: TokenizerLike, ids: list[int], length: int, rng: random.Random, pool: list[int]) -> str:
    """Text that the tokenizer encodes to exactly `length` tokens, starting from `ids`."""
    for _ in range(20):
        text = tok.decode(ids)
        again = tok.encode(text)
        if len(again) == length:
            return text
        ids = again[:length] if len(again) > length else again + [rng.choice(pool) for _ in range(length - len(again))]
    # Rare: merges keep shifting the length. Fall back on a run of one known single-token word.
    raise RuntimeError(f"could not build a prompt of exactly {length} tokens")


def _lengths(base: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_dataset(tok, num, input_len, output_len, range_ratio=0.0, prefix_len=0, seed=0) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = tok.sample_ids()
    prefix = exact_text(tok, [rng.choice(pool) for _ in range(prefix_len)], prefix_len, rng, pool) if prefix_len else ""
    out = []
    for in_len, out_len in zip(_lengths(input_len, range_ratio, num, rng), _lengths(output_len, range_ratio, num, rng)):
        body = exact_text(tok, [rng.choice(pool) for _ in range(in_len)], in_len, rng, pool)
        text = prefix + body
        n = len(tok.encode(text)) if prefix else in_len
        out.append(BenchRequest(text, n, out_len))
    return out


def prefix_repetition_dataset(tok, num, prefix_len, suffix_len, num_prefixes, output_len, seed=0) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = tok.sample_ids()
    prefixes = [
        exact_text(tok, [rng.choice(pool) for _ in range(prefix_len)], prefix_len, rng, pool)
        for _ in range(num_prefixes)
    ]
    out = []
    for i in range(num):
        suffix = exact_text(tok, [rng.choice(pool) for _ in range(suffix_len)], suffix_len, rng, pool)
        text = prefixes[i % num_prefixes] + suffix
        out.append(BenchRequest(text, len(tok.encode(text)), output_len))
    rng.shuffle(out)
    return out


def sharegpt_dataset(tok, path: str, num, output_len: int | None = None, seed=0) -> list[BenchRequest]:
    """ShareGPT layout: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_len = len(tok.encode(prompt))
        o_len = output_len or len(tok.encode(reply))
        # vLLM's filter: drop very short pairs and very long ones
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"{path}: only {len(out)} usable conversations, {num} asked")
    return out


# Pure-Python standard library modules whose functions the editing workload rewrites: real code that
# nobody here wrote, present wherever Python is (so the set is fixed per Python version)
EDITING_MODULES = (
    "textwrap", "shlex", "fnmatch", "colorsys", "calendar", "difflib", "heapq", "bisect", "string", "html",
    "ipaddress", "fractions", "statistics", "base64", "quopri", "gettext", "netrc", "ftplib", "configparser",
    "argparse", "csv", "tokenize", "pprint", "dataclasses", "inspect", "zipfile", "tarfile", "pathlib",
)  # fmt: skip
EDITING_TASKS = (
    "Add type hints to every parameter and to the return value of this Python function. Keep everything "
    "else as it is. Reply with the whole function only, in one ```python block.",
    "Rename the variable `{name}` to `{name}_value` everywhere in this Python function. Keep everything "
    "else as it is. Reply with the whole function only, in one ```python block.",
)


def editing_dataset(tok, num, seed=0, min_tokens=80, max_tokens=600) -> list[BenchRequest]:
    """Functions from the standard library's own source, each with an instruction to add type hints
    or rename one of its variables and give the whole function back: most of the answer repeats the
    prompt, as in real code edits. max_tokens is 1.3x the function's length; EOS ends a reply."""
    import ast
    import importlib
    import inspect
    import textwrap

    functions = []
    for name in EDITING_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                segment = _source_segment(lines, node)
                text = textwrap.dedent(segment) if segment else None
                if text and "\t" not in text:
                    names = sorted(
                        {a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")}
                    )
                    functions.append((text, names))
    rng = random.Random(seed)
    rng.shuffle(functions)
    out = []
    for text, names in functions:
        n = len(tok.encode(text))
        if not min_tokens <= n <= max_tokens:
            continue
        task = EDITING_TASKS[1].format(name=rng.choice(names)) if names and rng.random() < 0.5 else EDITING_TASKS[0]
        prompt = f"{task}\n\n```python\n{text}\n```"
        out.append(BenchRequest(prompt, len(tok.encode(prompt)), int(1.3 * n)))
        if len(out) == num:
            return out
    raise ValueError(f"the editing workload has {len(out)} functions of {min_tokens}-{max_tokens} tokens, {num} asked")


def _source_segment(lines: list[str], node) -> str:
    """ast.get_source_segment(source, node, padded=True) from the source's lines split once (the
    ast function splits the whole source again for every node: minutes for the editing modules)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    head = lines[first].encode()
    if first == last:
        return " " * len(head[: node.col_offset].decode()) + head[node.col_offset : node.end_col_offset].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join(
        [" " * len(head[: node.col_offset].decode()) + head[node.col_offset :].decode(), *lines[first + 1 : last], tail]
    )


def multiturn_dataset(
    tok, conversations: int, turns: int, turn_tokens: int, system_tokens: int, output_len: int, seed=0
) -> list[BenchRequest]:
    """Conversations of `turns` user messages of `turn_tokens` tokens each after a system prompt of
    `system_tokens` tokens (each conversation its own, random text as the random dataset's).
    The requests come conversation by conversation, turn by turn; the run (serve.py) sends each
    turn with the whole conversation so far, the model's actual earlier replies included (its
    input tokens then count the whole conversation's content). --request-rate paces the starts of
    conversations; --max-concurrency bounds the conversations in flight."""
    rng = random.Random(seed)
    pool = tok.sample_ids()
    out = []
    for c in range(conversations):
        system = (
            exact_text(tok, [rng.choice(pool) for _ in range(system_tokens)], system_tokens, rng, pool)
            if system_tokens
            else None
        )
        for t in range(turns):
            text = exact_text(tok, [rng.choice(pool) for _ in range(turn_tokens)], turn_tokens, rng, pool)
            out.append(
                BenchRequest(
                    text,
                    turn_tokens,
                    output_len,
                    conversation=c,
                    turn=t,
                    system=system,
                    system_len=system_tokens if system else 0,
                )
            )
    return out


def rerank_dataset(tok, num, query_len: int, num_documents: int, document_len: int, seed=0) -> list[BenchRequest]:
    """Rerank requests (bench serve: POST /v1/rerank): each a query of `query_len` tokens and
    `num_documents` documents of `document_len` tokens, random text as the random dataset's, new per
    request. prompt_len counts the query once per document (what the server's prompts hold, less
    the model's rerank template)."""
    rng = random.Random(seed)
    pool = tok.sample_ids()

    def text(n: int) -> str:
        return exact_text(tok, [rng.choice(pool) for _ in range(n)], n, rng, pool)

    out = []
    for _ in range(num):
        query = text(query_len)
        documents = [text(document_len) for _ in range(num_documents)]
        out.append(BenchRequest(query, num_documents * (query_len + document_len), 0, documents=documents))
    return out


def add_dataset_args(p, input_len: int, output_len: int, num_prompts: int) -> None:
    """The dataset flags of `vllm bench serve`, shared by bench serve and bench throughput."""
    p.add_argument(
        "--dataset-name",
        choices=["random", "prefix_repetition", "sharegpt", "editing", "multiturn", "rerank"],
        default="random",
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=input_len)
    p.add_argument("--random-output-len", type=int, default=output_len)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument(
        "--multiturn-conversations",
        type=int,
        default=16,
        help="multiturn: conversations (each a chain of turns; --max-concurrency of them at once)",
    )
    p.add_argument("--multiturn-turns", type=int, default=4, help="multiturn: user turns per conversation")
    p.add_argument("--multiturn-turn-tokens", type=int, default=64, help="multiturn: tokens of each new user message")
    p.add_argument(
        "--multiturn-system-prompt-tokens",
        type=int,
        default=256,
        help="multiturn: tokens of each conversation's own system prompt",
    )
    p.add_argument("--rerank-query-len", type=int, default=32, help="rerank: tokens of each request's query")
    p.add_argument("--rerank-num-documents", type=int, default=64, help="rerank: documents per request")
    p.add_argument("--rerank-document-len", type=int, default=200, help="rerank: tokens of each document")


def build_dataset(args, tok, seed: int) -> list[BenchRequest]:
    if args.dataset_name == "random":
        return random_dataset(
            tok,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            seed,
        )
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_dataset(
            tok,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            seed,
        )
    if args.dataset_name == "multiturn":
        return multiturn_dataset(
            tok,
            args.multiturn_conversations,
            args.multiturn_turns,
            args.multiturn_turn_tokens,
            args.multiturn_system_prompt_tokens,
            args.random_output_len,
            seed,
        )
    if args.dataset_name == "editing":
        return editing_dataset(tok, args.num_prompts, seed)
    if args.dataset_name == "rerank":
        return rerank_dataset(
            tok, args.num_prompts, args.rerank_query_len, args.rerank_num_documents, args.rerank_document_len, seed
        )
    if not args.dataset_path:
        raise SystemExit("treadle bench: --dataset-path is required for sharegpt")
    return sharegpt_dataset(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len, seed)
