"""One sequence as the engine core schedules it: its tokens and how many of them have KV."""

import enum

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A sequence. `n > 1` requests are a group of these sharing `group_id`, one per choice.

    Invariant: 0 <= num_computed_tokens <= num_tokens; tokens [0, num_computed_tokens) have KV in
    the request's blocks. The scheduler closes the gap; a preemption resets it to 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        group_id: str | None = None,
        index: int = 0,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index  # choice index within the group
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"
