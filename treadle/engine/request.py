"""One sequence as the engine core schedules it: its tokens and how many of them have KV."""

import enum

from treadle.sampling_params import SamplingParams
from treadle.step import TokenHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


SPEC_PRIOR_ACCEPT_RATE = 0.5


class Request(TokenHistory):
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
        images: list | None = None,
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
        self.images = images or []  # step.ImageInput of its prompt: their tokens come from the vision encoder
        self.lora = 0  # the LoRA adapter's id (EngineCore.loras); 0: the base model
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None
        self.matcher = None  # structured output: the grammar's llguidance matcher, once compiled
        self.grammar_active = False  # whether the matcher follows the output yet (after reasoning)
        self.spec_token_ids: list[int] = []  # speculative decoding: this step's proposed next tokens
        self.spec_accept_rate = SPEC_PRIOR_ACCEPT_RATE  # running average of accepted / proposed
        self.draft_num_computed = 0  # draft model: positions whose draft KV is valid
        self.draft_preemptions = 0  # num_preemptions when that count was last valid

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def image_around(self, position: int):
        """The image whose tokens lie on both sides of `position` (a chunk or a prefix hit may not
        end there: an image's tokens are computed in one step, attending to each other), else None."""
        for img in self.images:
            if img.offset < position < img.offset + img.length:
                return img
        return None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def validate_prompt(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The checks every request passes, in the front end and again in the core."""
    if not token_ids:
        raise ValueError("the prompt is empty (0 tokens)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens; the model's maximum length is {max_model_len}, "
            "which leaves no room to generate"
        )
    if params.logit_bias and any(not 0 <= t < vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias names a token id outside the vocabulary [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids names a token id outside the vocabulary [0, {vocab_size})")
    if params.score_token_ids and any(not 0 <= t < vocab_size for t in params.score_token_ids):
        raise ValueError(f"score_token_ids names a token id outside the vocabulary [0, {vocab_size})")


def head_refusal(head_labels: list[str] | None, params: SamplingParams) -> str | None:
    """Why a model whose output head is a classifier over `head_labels` (ModelConfig.head_labels: a
    reranker GGUF's) cannot run this request, or None: it scores and embeds, and generates nothing.
    The front end asks first (a 400 before a stream starts), the core again."""
    if head_labels is None or params.pooling in ("last", "mean"):
        return None
    if params.pooling is None:
        return (
            f"this model's output head is a classifier over the labels {list(head_labels)} (a reranker GGUF's "
            "cls.output.weight), not the vocabulary: it scores (/v1/rerank, /v1/score) and cannot generate"
        )
    if any(not 0 <= t < len(head_labels) for t in params.score_token_ids):
        return f"score_token_ids names a column outside the model's classifier head [0, {len(head_labels)})"
    return None
