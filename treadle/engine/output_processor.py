"""The front end's half of every request: token ids from the engine core in, text out.

For each choice it keeps the incremental detokenizer, the text so far, the logprobs with their
token text, and what has been handed out. `process()` turns the core's `CoreOutput`s into vLLM's
`RequestOutput` deltas and finds stop strings; a choice that hits one is finished here and named
in the returned abort list, which the caller sends to the core. Runs in the HTTP process for
`treadle serve` and in-process for `LLM(...)`: same code, same text.
"""

import functools

from treadle.engine.messages import CoreOutput, child_request_id
from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.text.detokenizer import IncrementalDetokenizer, find_stop_string, partial_stop_suffix


class ChoiceState:
    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, want_logprobs: bool):
        self.index = index
        self.detokenizer = detokenizer
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.embedding: list[float] | None = None
        self.sent_text_len = 0
        self.sent_token_len = 0
        self.final_output_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, choices
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices: list[ChoiceState] = choices
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.client_error = False
        self.grammar_ready = False  # the core has compiled its output constraint

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        # one token's text, for logprobs: the same ids come back step after step
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False)
        )

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        choices = [
            ChoiceState(
                i,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                params.logprobs is not None,
            )
            for i in range(params.n)
        ]
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, choices)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """End a request here (the caller aborts it in the core): its final output, or None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for c in state.choices:
            if not c.finished:
                c.finish_reason = reason
        state.error = state.error or error
        del self.requests[request_id]
        return self._output(state)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutput deltas of the requests with news, and the core ids of choices to abort."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted here already; the core's last words about it
            choice = state.choices[out.index]
            if choice.finished:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            touched[state.request_id] = state
            if out.grammar_ready:
                state.grammar_ready = True
                continue
            if out.finish_reason == "error":  # a failed step or a refused request: every choice ends
                state.error = out.error
                state.client_error = out.client_error
                for c in state.choices:
                    c.finish_reason = c.finish_reason or "error"
                continue
            if self._update(state.params, choice, out):
                to_abort.append(child_request_id(state.request_id, state.params.n, choice.index))
        outputs = []
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                del self.requests[state.request_id]
        return outputs, to_abort

    def _update(self, p: SamplingParams, choice: ChoiceState, out: CoreOutput) -> bool:
        """Apply one core output to a choice; True when a stop string ended it (abort it in the core)."""
        last = len(out.new_token_ids) - 1
        for j, token in enumerate(out.new_token_ids):
            choice.token_ids.append(token)
            if out.new_logprobs is not None and choice.logprobs is not None:
                entry = {t: Logprob(v, rank, self._token_text(t)) for t, v, rank in out.new_logprobs[j]}
                choice.logprobs.append(entry)
                choice.cumulative_logprob += out.new_logprobs[j][0][1]
            if j == last and out.finish_reason == "stop":  # a stop token or EOS, decided by the core
                if p.include_stop_str_in_output:
                    choice.text += choice.detokenizer.push(token)
                choice.finish_reason, choice.stop_reason = "stop", out.stop_reason
                return False
            delta = choice.detokenizer.push(token)
            choice.text += delta
            if delta and p.stop_strings and len(choice.token_ids) >= p.min_tokens:
                hit = find_stop_string(choice.text, p.stop_strings, len(delta))
                if hit is not None:
                    idx, stop = hit
                    choice.text = choice.text[: idx + len(stop)] if p.include_stop_str_in_output else choice.text[:idx]
                    choice.finish_reason, choice.stop_reason = "stop", stop
                    return out.finish_reason is None
        if out.embedding is not None:
            choice.embedding = out.embedding
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason
        return False

    def _output(self, state: RequestState) -> RequestOutput:
        """The deltas of every choice with news since the last output of this request."""
        outs = []
        stops = state.params.stop_strings
        for c in state.choices:
            end = len(c.text)
            if not c.finished and stops:
                end -= partial_stop_suffix(c.text, stops)
            end = max(end, c.sent_text_len)
            new_tokens = c.token_ids[c.sent_token_len :]
            text = c.text[c.sent_text_len : end]
            newly_finished = c.finished and not c.final_output_sent
            if not new_tokens and not text and not newly_finished:
                continue
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=new_tokens,
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=c.logprobs[c.sent_token_len :] if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    embedding=c.embedding if newly_finished else None,
                )
            )
            c.sent_text_len = end
            c.sent_token_len = len(c.token_ids)
            c.final_output_sent = c.finished
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            client_error=state.client_error,
            grammar_ready=state.grammar_ready,
        )
