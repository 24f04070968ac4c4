"""Structured output: a grammar per request, applied as a token mask in the sampler.

A request's constraint (`StructuredOutputsParams`: a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF / GBNF / Lark grammar) becomes one llguidance grammar
(`grammar_spec`). `GrammarCompiler` compiles it into an `LLMatcher` for the tokenizer, within
resource limits, and caches compiled grammars by their canonical text; each choice of each
request gets its own copy of the matcher, which then follows that choice's tokens.

Who does what (docs/architecture.md, "Structured output"):
- the front end checks the constraint (size, compile errors, compile time) before it answers, so a
  grammar that cannot compile is a 400 and never reaches the engine;
- the engine core compiles it again off its loop (a thread; llguidance drops the GIL), keeps the
  request waiting for its grammar meanwhile, then, every step, computes the allowed-token bitmask
  of each constrained row that samples and hands it to the runner as plain bytes;
- the sampler sets the logits of disallowed tokens to -inf, after penalties and bias; logprobs
  stay those of the raw model distribution.
"""

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from treadle.sampling_params import StructuredOutputsParams

# JSON whitespace: none, one space, or a newline with up to 20 spaces or tabs of indentation
# between tokens (llama.cpp's json-schema-to-grammar rule). Compact, spaced and pretty-printed JSON
# all fit, and a small model cannot loop on whitespace forever.
JSON_WHITESPACE = r"(?:[ ]|\n[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
CACHE_SIZE = 256
GRAMMAR_THREADS = 2  # one slow grammar must not hold up every other constrained request
MAX_REMEMBERED_SLOW = 1024
# llguidance's limits, but for the Earley row size: 2000 (its default) refuses objects with a
# thousand optional properties at their first token; the work of one step stays bounded by
# step_max_items (50,000) whatever this is.
MAX_ITEMS_IN_ROW = 20_000
PROBE_TOKENS = 3  # tokens a new grammar is walked through at compile time, to refuse one that cannot start


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint, within its frame if it has one; ValueError naming
    the problem if it has none."""
    spec = _constraint_spec(so)
    if so.frame is None:
        return spec
    try:  # a top-level grammar (JSON: a schema's, a regex's) of one grammar, or Lark text
        (inner,) = json.loads(spec)["grammars"]
    except ValueError:
        inner = {"lark_grammar": spec}
    return json.dumps({"grammars": [{"lark_grammar": so.frame}, {**inner, "name": "constraint"}]})


def _constraint_spec(so: StructuredOutputsParams) -> str:
    import llguidance

    kind = so.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(so.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise ValueError(f"the grammar is not valid: {e}") from None
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises bare Exceptions
        raise ValueError(f"the grammar is not valid: {e}") from None


class GrammarCompiler:
    """Compiles constraints into llguidance matchers for one tokenizer; thread-safe, cached."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> a compiled matcher (or an error text)
        self.compiled = 0  # cache misses, for /stats
        self.cache_hits = 0

    def _ll(self):
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=self.vocab_size, eos_token=sorted(tok.stop_token_ids)
                )
            return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams):
        """A fresh matcher for `so` at its start; ValueError naming the problem if it cannot compile."""
        import llguidance

        key = so.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
        if cached is None:
            try:
                spec = grammar_spec(so)
            except ValueError as e:
                cached = str(e)
            else:
                limits = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)
                matcher = llguidance.LLMatcher(self._ll(), spec, log_level=0, limits=limits)
                error = matcher.get_error() if matcher.is_error() else self._probe(matcher)
                cached = f"the {_NAMES[so.kind]} cannot be used: {error}" if error else matcher
            with self._lock:
                self.compiled += 1
                self._cache[key] = cached
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise ValueError(cached)
        return cached.deep_copy()

    def _probe(self, matcher) -> str | None:
        """Walk a copy of a new matcher through its first few tokens (the first allowed one each
        time): a grammar too complex for the parser's limits fails here, not mid-reply."""
        words = np.empty(self.mask_words, dtype=np.int32)
        self.fill_mask(matcher, words)  # the first mask, computed once here: copies start warm
        probe = matcher.deep_copy()
        for _ in range(PROBE_TOKENS):
            if probe.is_stopped():
                return None
            self.fill_mask(probe, words)
            if probe.is_error():
                break
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size])
            if not allowed.size:
                return "no token can start the output"
            if not probe.consume_token(int(allowed[0])):
                break
        return probe.get_error().splitlines()[0] if probe.is_error() else None

    def fill_mask(self, matcher, out: np.ndarray) -> None:
        """The allowed next tokens of `matcher` as a bitmask (int32 words, bit t of word t // 32)."""
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)


class MatcherWalk:
    """A request's matcher walked ahead through proposed tokens (speculative decoding) on a copy
    (2 us), so the request's own matcher never needs putting back: llguidance's `rollback` does
    not count an end-of-sequence token that stopped an accepting grammar, and a stopped matcher
    (only EOS may follow) takes no more tokens."""

    def __init__(self, compiler: GrammarCompiler, matcher):
        self.compiler, self.matcher = compiler, matcher.deep_copy()

    def mask(self, out: np.ndarray) -> None:
        self.compiler.fill_mask(self.matcher, out)

    def advance(self, token: int) -> bool:
        """Consume a token; False if the grammar refuses it. Proposals are drawn under the mask or
        cut where it refuses them, so a refusal is the parser giving up (past its limits): the copy
        is then in error, and its masks allow only EOS. The rows after a refused proposal are
        discarded anyway unless the target samples that token, and then the request's own matcher
        ends the request as plain decoding would."""
        if self.matcher.is_stopped():
            return True
        return self.matcher.consume_token(token)

    def masks(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """The masks before each token and after the last ([len(tokens) + 1, words]), and how many
        of the tokens the grammar refused."""
        words = np.empty((len(tokens) + 1, self.compiler.mask_words), dtype=np.int32)
        refused = 0
        for row, token in enumerate([*tokens, None]):
            self.mask(words[row])
            if token is not None:
                refused += not self.advance(token)
        return words, refused


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


GRAMMAR_THREAD_NICE = 10


def lower_thread_priority() -> None:
    """For grammar-compiling threads: on two cores a compile must not take a core from decoding
    (Linux: a thread's nice value is its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_THREAD_NICE)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- the engine core's side


def accept_token(req, token: int) -> tuple[str | None, bool]:
    """Advance a constrained request's matcher by one output token: (the error if the grammar
    cannot go on, whether the grammar is complete). A grammar waiting for its `after_token` starts
    after it."""
    if not req.grammar_active:
        req.grammar_active = token == req.params.structured_outputs.after_token
        return None, False
    if not req.matcher.consume_token(token):
        # a grammar too complex to go on (past llguidance's limits): the request's own doing
        return f"the output constraint cannot continue: {req.matcher.get_error().splitlines()[0]}", False
    return None, req.matcher.is_stopped()


@dataclass
class AwaitedGrammar:
    future: Future  # the matchers, one per choice
    since: float  # when the request arrived (time.monotonic)
    key: str  # the constraint's canonical text


class StructuredOutputManager:
    """The grammar lifecycle of the engine core's requests: compile on a thread while the request
    waits (never in a step), ready or refused (a compile error, or past
    max_grammar_compile_seconds: refused at once the next time), then each step's bitmasks and
    each sampled token's advance of the request's matcher."""

    def __init__(self, tokenizer, vocab_size: int, max_compile_seconds: float):
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.max_compile_seconds = max_compile_seconds
        self._pool: ThreadPoolExecutor | None = None
        self._awaiting: dict[str, AwaitedGrammar] = {}  # group id -> its matchers, one per choice
        self._too_slow: set[str] = set()  # constraints that ran out of compile time, by canonical text

    @property
    def num_waiting(self) -> int:
        return len(self._awaiting)

    def slow_error(self) -> str:
        return (
            f"the output constraint took longer than {self.max_compile_seconds:g} s to compile "
            "(--max-grammar-compile-seconds)"
        )

    def submit(self, request_id: str, so: StructuredOutputsParams, n: int) -> str | None:
        """Start compiling a request's grammar (one matcher per choice); the refusal's text instead
        if this constraint ran out of time before."""
        if so.key() in self._too_slow:
            return self.slow_error()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                GRAMMAR_THREADS, thread_name_prefix="treadle-grammar", initializer=lower_thread_priority
            )
        future = self._pool.submit(lambda: [self.compiler.compile(so) for _ in range(n)])
        self._awaiting[request_id] = AwaitedGrammar(future, time.monotonic(), so.key())
        return None

    def take_finished(self, live: set | dict, idle: bool) -> list[tuple[str, list | None, str | None]]:
        """The requests whose grammars are settled: (id, matchers, None) once compiled, (id, None,
        error) when refused. Requests no longer `live` (aborted while compiling) are dropped. With
        nothing else to run (`idle`), wait a little for one."""
        if not self._awaiting:
            return []
        if idle:
            wait([a.future for a in self._awaiting.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        now, settled = time.monotonic(), []
        for rid, awaited in list(self._awaiting.items()):
            if rid not in live:
                del self._awaiting[rid]
                continue
            if not awaited.future.done():
                if now - awaited.since > self.max_compile_seconds:
                    del self._awaiting[rid]
                    if len(self._too_slow) < MAX_REMEMBERED_SLOW:
                        self._too_slow.add(awaited.key)  # refused at once the next time
                    settled.append((rid, None, self.slow_error()))
                continue
            del self._awaiting[rid]
            try:
                settled.append((rid, awaited.future.result(), None))
            except ValueError as e:
                settled.append((rid, None, str(e)))
        return settled

    def masks(self, step, requests: dict) -> tuple[dict[str, bytes], int]:
        """The allowed-token bitmasks of every constrained sample of the step: one, or for a request
        verifying proposals one per row (a copy of the matcher walked through the proposals); and
        how many proposals a grammar refused (a parser past its limits)."""
        masks, refused = {}, 0
        for s in step.scheduled:
            for req_id in s.sample_ids:
                req = requests[req_id]
                if req.matcher is not None and req.grammar_active:
                    drafts = s.token_ids[len(s.token_ids) - s.num_drafts :] if s.num_drafts else []
                    words, n = MatcherWalk(self.compiler, req.matcher).masks(drafts)
                    refused += n
                    masks[req_id] = words.tobytes()
        return masks, refused

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
