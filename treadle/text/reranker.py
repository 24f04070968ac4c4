"""Rerankers: which models score (query, document) pairs, and the prompt of each pair.

A causal LM reranks by answering "yes" or "no" at the end of a prompt that holds the query and the
document; the score is p(yes) = softmax over the (no, yes) logits at the prompt's last position, as
Qwen3-Reranker defines it (the engine computes it: SamplingParams pooling "score"). A model is a
reranker by `--rerank-config` (EngineConfig.rerank_config, a JSON text or a dict), in one of two forms:

- treadle's own: {"template": "...{instruction}...{query}...{doc}...", "instruction": "the default
  instruction", "yes_token": "yes", "no_token": "no"}; the template is the whole prompt text,
  special tokens included ({document} is taken for {doc}; {instruction} is optional);
- vLLM's `hf_overrides` names for Qwen3-Reranker: {"classifier_from_token": ["no", "yes"],
  "is_original_qwen3_reranker": true} ("architectures" may come with them): Qwen3-Reranker's
  published prompt (QWEN3_TEMPLATE) and default instruction;

or by a GGUF file's own metadata, where llama.cpp's converter marks a Qwen3-Reranker:
`{arch}.pooling_type` = 4 (RANK), `{arch}.classifier.output_labels` = [yes, no] and the prompt in
`tokenizer.chat_template.rerank_instruct` ({instruction}, {query}, {document}) or
`tokenizer.chat_template.rerank` (its instruction written in), encoded as llama-server encodes it. That
converter also replaces the output head by `cls.output.weight`, the lm_head rows of the labels (no
`output.weight`): the model's logits are then those rows (ModelConfig.head_labels), the score reads
the columns of the yes and no labels, and the model cannot generate.

The yes and no tokens are names in the model's vocabulary (as transformers' convert_tokens_to_ids
reads them), or a text that encodes to exactly one token. A pair's prompt is the template with its
placeholders filled in one pass (a query holding "{doc}" stays as written), encoded without added
special tokens: every document of one query shares the prompt's tokens up to the document, so the
engine's prefix cache computes the instruction and the query once.
"""

import dataclasses
import json
import re
from dataclasses import dataclass

# Qwen3-Reranker's model card (format_instruction, prefix, suffix), as one template
QWEN3_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
GGUF_RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
_PLACEHOLDER = re.compile(r"\{(instruction|query|doc|document)\}")
_OWN_KEYS = {"template", "instruction", "yes_token", "no_token"}
_VLLM_KEYS = {"classifier_from_token", "is_original_qwen3_reranker", "architectures"}


@dataclass(frozen=True)
class RerankConfig:
    """A reranker's prompt and answer tokens. `instruction`: the default of a template that has
    {instruction} (a request may give its own); None for a template without one."""

    template: str
    instruction: str | None = None
    yes_token: str = "yes"
    no_token: str = "no"
    # the labels of the model's output head rows where that head is a classifier (a GGUF file's
    # cls.output.weight), read from the file, never from --rerank-config: yes_token and no_token are
    # two of them; None: the head is the vocabulary
    head_labels: tuple[str, ...] | None = None

    def __post_init__(self):
        fail = _failure("rerank_config")
        if not isinstance(self.template, str) or "{query}" not in self.template:
            fail("template must be a string holding {query} and {doc}")
        if "{doc}" not in self.template and "{document}" not in self.template:
            fail("template must hold {doc} (or {document})")
        takes = "{instruction}" in self.template
        if takes and not (isinstance(self.instruction, str) and self.instruction):
            fail("the template holds {instruction}: give its default as instruction (a non-empty string)")
        if not takes and self.instruction is not None:
            fail("instruction is given but the template has no {instruction}")
        for name in ("yes_token", "no_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                fail(f"{name} must be a non-empty string")
        if self.yes_token == self.no_token:
            fail(f"yes_token and no_token must differ (both {self.yes_token!r})")

    @property
    def takes_instruction(self) -> bool:
        return "{instruction}" in self.template

    @classmethod
    def parse(cls, value) -> "RerankConfig | None":
        """From a JSON text, a dict (either form) or a RerankConfig; None stays None. ValueError
        names what is wrong."""
        if value is None or isinstance(value, RerankConfig):
            return value
        fail = _failure("rerank_config")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                fail(f"not valid JSON: {e}")
        if not isinstance(value, dict):
            fail(f"must be a JSON object, got {type(value).__name__}")
        if "template" in value:
            extra = sorted(set(value) - _OWN_KEYS)
            if extra:
                fail(f"unknown key {extra[0]!r} (treadle's form takes {', '.join(sorted(_OWN_KEYS))})")
            return cls(**value)
        if "classifier_from_token" in value:
            extra = sorted(set(value) - _VLLM_KEYS)
            if extra:
                fail(f"unknown key {extra[0]!r} (vLLM's form takes {', '.join(sorted(_VLLM_KEYS))})")
            tokens = value["classifier_from_token"]
            if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) and t for t in tokens)):
                fail(f"classifier_from_token must be two token names [no, yes], got {tokens!r}")
            if value.get("is_original_qwen3_reranker") is not True:
                fail(
                    "classifier_from_token is read with is_original_qwen3_reranker: true (Qwen3-Reranker's prompt); "
                    "for another prompt use treadle's form {template, instruction, yes_token, no_token}"
                )
            return cls(QWEN3_TEMPLATE, QWEN3_INSTRUCTION, yes_token=tokens[1], no_token=tokens[0])
        fail('needs "template" (treadle\'s form) or "classifier_from_token" (vLLM\'s Qwen3-Reranker form)')


def _failure(where: str):
    def fail(message: str):
        raise ValueError(f"{where}: {message}")

    return fail


def head_labels(metadata: dict, tensor_names) -> tuple[str, ...] | None:
    """The labels of a GGUF file's classifier head rows (`cls.output.weight`), None without one (the
    loader refuses a head whose labels do not match its rows)."""
    labels = metadata.get(f"{metadata.get('general.architecture')}.classifier.output_labels")
    return tuple(labels) if "cls.output.weight" in tensor_names and isinstance(labels, list) else None


def config_from_gguf(metadata: dict, tensor_names=()) -> RerankConfig | None:
    """The rerank config llama.cpp's converter wrote into a GGUF file's metadata, or None where the
    file is no causal yes/no reranker (its rank pooling without two labels and a rerank template is
    a cross-encoder's classifier head, which treadle does not run). `tensor_names`: the file's, to
    see whether its head is the classifier."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or metadata.get(f"{arch}.pooling_type") != GGUF_RANK_POOLING:
        return None
    labels = metadata.get(f"{arch}.classifier.output_labels")
    with_instruction = metadata.get("tokenizer.chat_template.rerank_instruct")
    template = with_instruction if isinstance(with_instruction, str) else metadata.get("tokenizer.chat_template.rerank")
    if not (isinstance(labels, list) and len(labels) == 2 and all(isinstance(x, str) for x in labels)):
        return None
    if not isinstance(template, str):
        return None
    instruction = QWEN3_INSTRUCTION if "{instruction}" in template else None
    try:  # llama.cpp's classifier rows: [yes, no], the softmax's first output the score
        return RerankConfig(
            template,
            instruction,
            yes_token=labels[0],
            no_token=labels[1],
            head_labels=head_labels(metadata, tensor_names),
        )
    except ValueError:
        return None


def _read_gguf(path: str) -> tuple[dict, set[str]]:
    """A GGUF file's metadata (its vocabulary read past) and tensor names."""
    from treadle.model.loading.gguf_file import open_gguf

    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    file = open_gguf(path, tensors=False, skip=big)
    return file.metadata, {info[0] for info in file.infos}


def config_from_gguf_file(path: str) -> RerankConfig | None:
    return config_from_gguf(*_read_gguf(path))


def model_rerank_config(model_path: str | None, configured) -> RerankConfig | None:
    """The model's rerank config: the one given (--rerank-config), else its GGUF file's own; a GGUF
    file's classifier head (head_labels) either way."""
    config = RerankConfig.parse(configured)
    if not (isinstance(model_path, str) and model_path.endswith(".gguf")):
        return config
    metadata, names = _read_gguf(model_path)
    if config is None:
        return config_from_gguf(metadata, names)
    labels = head_labels(metadata, names)
    return config if labels is None else dataclasses.replace(config, head_labels=labels)


class Reranker:
    """A RerankConfig on a model's tokenizer: the (no, yes) columns of the model's logits (token ids,
    or a classifier head's rows) and each pair's prompt ids. ValueError where a token is not one
    token of the vocabulary (not one of a classifier head's labels)."""

    def __init__(self, config: RerankConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.yes_id = self._column("yes_token", config.yes_token)
        self.no_id = self._column("no_token", config.no_token)
        if self.yes_id == self.no_id:
            raise ValueError(f"rerank_config: yes_token and no_token are the same token (id {self.yes_id})")

    @property
    def score_token_ids(self) -> list[int]:
        return [self.no_id, self.yes_id]

    def _column(self, name: str, token: str) -> int:
        labels = self.config.head_labels
        if labels is None:
            return self._token_id(name, token)
        if token not in labels:
            raise ValueError(
                f"rerank_config: {name} {token!r} is not one of the labels {list(labels)} of the model's "
                "classifier head (its GGUF file's cls.output.weight)"
            )
        return labels.index(token)

    def _token_id(self, name: str, token: str) -> int:
        found = self.tokenizer.backend.token_to_id(token)
        if found is not None:
            return found
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
        raise ValueError(
            f"rerank_config: {name} {token!r} is not one token of the model's vocabulary (it encodes to {len(ids)})"
        )

    def prompt(self, query: str, doc: str, instruction: str | None = None) -> str:
        """The pair's prompt text. ValueError for an instruction the template cannot take."""
        if instruction is not None and not self.config.takes_instruction:
            raise ValueError("this model's rerank prompt has no {instruction}: it takes none")
        values = {
            "instruction": self.config.instruction if instruction is None else instruction,
            "query": query,
            "doc": doc,
            "document": doc,
        }
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.config.template)

    def prompt_ids(self, query: str, doc: str, instruction: str | None = None) -> list[int]:
        return self.tokenizer.encode(self.prompt(query, doc, instruction), add_special_tokens=False)
