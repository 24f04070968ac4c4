"""Read a GGUF file: hyperparameters, weights under HF names, tokenizer.

Quantized matrices stay as the file's blocks (`QuantizedTensor`, copied off the map tensor by
tensor); float tensors are converted when the model takes them.

treadle's own reader (`gguf_file.py`, one memory map parsed with `struct`) parses the container;
gguf-py's `constants` module names the tensor types, and its `gguf.quants` dequantizes the blocks
of types treadle's kernels do not hold (the package is imported only then: ~25 ms). This
module maps llama.cpp's names and layouts onto the Hugging Face ones the model code uses, and turns
every failure into a `ModelLoadError` that names the file, the item and the reason.
"""

import os

import numpy as np
import torch

from treadle.model.config import (
    LIMITS,
    ModelConfig,
    ModelFiles,
    ModelLoadError,
    MoEConfig,
    RopeConfig,
    check_config,
    file_float,
    file_int,
    yarn_mscale,
)
from treadle.model.families.registry import gguf_architectures, resolve_model_class
from treadle.model.kernels import quant
from treadle.model.kernels.quant import QuantizedTensor
from treadle.model.layers.moe import ExpertWeights
from treadle.model.loading import gguf_prefetch
from treadle.model.loading.deferred import DeferredWeight
from treadle.model.loading.gguf_file import open_gguf
from treadle.model.loading.gguf_names import LONGROPE_TENSORS, hf_name
from treadle.text.tokenizer import UNREAD_AT_LOAD, tokenizer_from_gguf

# Tensor types we load: plain floats, and the quantized ones listed here (`gguf` can dequantize them).
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4",
)


class GGUFConfig:
    """A GGUF file's `{arch}.*` hyperparameters as a family's reader takes them: each missing or
    wrong one a ModelLoadError naming the file and the key."""

    def __init__(self, path: str, meta: dict, arch: str, tensor_names: set[str]):
        self.path, self.meta, self.arch, self.tensor_names = path, meta, arch, tensor_names

    def get(self, key: str, default=None, required: bool = False):
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            if required:
                raise ModelLoadError(f"{self.path}: {full}: missing")
            return default
        return self.meta[full]

    def number(self, key: str, lo: int, hi: int, default=None, required: bool = False) -> int:
        return file_int(self.path, f"{self.arch}.{key}", self.get(key, default, required), lo, hi)

    def fail(self, key: str, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {self.arch}.{key}: {message}")

    def rope(self, theta_key: str = "rope.freq_base") -> RopeConfig:
        rope = RopeConfig(theta=self.get(theta_key, 10000.0))
        scaling = self.get("rope.scaling.type")
        if scaling in (None, "none"):
            return rope
        if scaling not in ("linear", "yarn"):
            raise self.fail(
                "rope.scaling.type",
                f"{scaling!r}: unsupported RoPE scaling (supported: linear, yarn, llama3 via rope_freqs)",
            )
        rope.scaling_type = scaling
        rope.factor = self.get("rope.scaling.factor", 1.0)
        if scaling == "yarn":  # as llama.cpp applies it: YaRN's temperature times the file's attn_factor
            rope.original_max_position = self.get("rope.scaling.original_context_length", required=True)
            rope.beta_fast = self.get("rope.scaling.yarn_beta_fast", 32.0)
            rope.beta_slow = self.get("rope.scaling.yarn_beta_slow", 1.0)
            factor = file_float(self.path, f"{self.arch}.rope.scaling.factor", rope.factor)
            extra = file_float(
                self.path, f"{self.arch}.rope.scaling.attn_factor", self.get("rope.scaling.attn_factor", 1.0)
            )
            rope.attention_factor = yarn_mscale(factor) * extra
        return rope

    def llama_style(
        self, config_class=ModelConfig, partial_rotary: bool = False, per_layer_kv_heads: bool = False, **fields
    ) -> ModelConfig:
        """The hyperparameters every Llama-style file gives, `fields` given or overriding; not yet
        checked. `partial_rotary`: the family rotates the first `rope.dimension_count` of each head
        (NEOX-style, as Phi-3 / Phi-4-mini), where other families refuse a smaller count.
        `per_layer_kv_heads`: a list of KV head counts is taken where its non-zero ones agree (a
        hybrid's: 0 for a recurrent layer; the family reads the layers' kinds from it)."""
        hidden = self.number("embedding_length", *LIMITS["hidden_size"], required=True)
        heads = self.number("attention.head_count", *LIMITS["num_heads"], required=True)
        kv_heads = self.get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list) and per_layer_kv_heads == "family":  # the family reads the list itself
            kv_heads = kv_heads[0]
        elif isinstance(kv_heads, list):
            counts = {n for n in kv_heads if n}
            if not per_layer_kv_heads or len(counts) != 1:
                raise self.fail("attention.head_count_kv", "per-layer head counts are not supported")
            kv_heads = counts.pop()
        head_dim = self.number("attention.key_length", *LIMITS["head_dim"], default=hidden // heads)
        if self.get("attention.value_length", head_dim) != head_dim:
            raise self.fail("attention.value_length", "differs from key_length, not supported")
        rope_dim = self.get("rope.dimension_count", head_dim)
        if rope_dim != head_dim and not partial_rotary:
            raise self.fail(
                "rope.dimension_count",
                f"{rope_dim!r}: partial rotary embeddings are not supported for this architecture",
            )
        rope = self.rope()
        if rope_dim != head_dim:
            rope.rotary_dim = rope_dim  # checked with the rest
        vocab = self.meta.get("tokenizer.ggml.tokens")
        names = self.tensor_names
        values = dict(
            architecture=self.arch,
            vocab_size=self.get(
                "vocab_size", len(vocab) if isinstance(vocab, list) and vocab else 1
            ),  # the embedding's rows, once read
            hidden_size=hidden,
            # (a family that sizes its feed-forward otherwise gives it: a file may lack the key)
            intermediate_size=fields.get("intermediate_size") or self.get("feed_forward_length", required=True),
            num_layers=self.get("block_count", required=True),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=self.get("attention.layer_norm_rms_epsilon", 1e-5),
            rope=rope,
            max_position=self.get("context_length", 4096),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=self.get("attention.sliding_window") or None,  # llama.cpp's converters write 0 for none
            moe=self.moe(norm_topk=True),
            name=str(self.meta.get("general.name") or os.path.basename(self.path)),
        )
        values.update(fields)
        return config_class(**values)

    def moe(self, norm_topk: bool) -> MoEConfig | None:
        """The experts a file declares (`expert_count`), every layer sparse, as llama.cpp runs
        these architectures; `norm_topk`: whether the chosen experts' weights are renormalised
        (llama.cpp fixes it per architecture: Mixtral and Qwen3-MoE yes, Qwen2-MoE and OLMoE no)."""
        if not self.get("expert_count", 0):
            return None
        return MoEConfig(
            num_experts=self.get("expert_count"),
            top_k=self.get("expert_used_count", required=True),
            expert_size=self.get("expert_feed_forward_length", self.get("feed_forward_length")),
            norm_topk=norm_topk,
            shared_size=self.get("expert_shared_feed_forward_length", 0),
        )

    def checked(self, config: ModelConfig) -> ModelConfig:
        keys = {
            "vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_layers": "block_count", "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
            "head_dim": "attention.key_length", "max_position": "context_length",
            "sliding_window": "attention.sliding_window", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
            "rope_theta": "rope.freq_base", "rope_factor": "rope.scaling.factor",
            "num_experts": "expert_count", "top_k": "expert_used_count", "expert_size": "expert_feed_forward_length",
            "shared_size": "expert_shared_feed_forward_length",
        }  # fmt: skip
        return check_config(self.path, config, {field: f"{self.arch}.{key}" for field, key in keys.items()})


def _config_from_metadata(path: str, meta: dict, tensor_names: set[str]) -> ModelConfig:
    """The architecture's family reads its own hyperparameters (`CausalLM.config_from_gguf`)."""
    arch = meta.get("general.architecture")
    supported = gguf_architectures()
    if arch not in supported:
        raise ModelLoadError(
            f"{path}: general.architecture = {arch!r}: unsupported architecture (supported: {', '.join(supported)})"
        )
    return resolve_model_class(arch).config_from_gguf(GGUFConfig(path, meta, arch, tensor_names))


def _undo_qk_permutation(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute (HF rows (head, 2, half) -> interleaved (head, half, 2))."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_supported(path: str, tensor) -> None:
    if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name}: type {tensor.tensor_type.name} is not supported "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )


def _dequantize(path: str, tensor) -> np.ndarray:
    _check_supported(path, tensor)
    type_name = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest first
    try:
        if type_name == "F32":
            data = np.asarray(tensor.data, dtype=np.float32)
        elif type_name == "F16":
            data = np.asarray(tensor.data).astype(np.float32)
        else:
            from gguf import quants  # the package (~25 ms to import): only types the kernels do not hold

            data = quants.dequantize(tensor.data, tensor.tensor_type)
        return data.reshape(shape)
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: cannot decode {type_name} data: {e}") from e


def _float_weight(path: str, reader, tensor, heads: int | None, hf_name: str, family) -> torch.Tensor:
    data = _dequantize(path, tensor)
    if heads is not None:
        data = _undo_qk_permutation(data, heads)
    data = family.from_gguf_tensor(hf_name, data)  # the family's own conventions (Gemma's norms)
    weight = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy, off the memmap
    reader.release(tensor, around=True)
    return weight


def _quantized_weight(path: str, reader, tensor, heads: int | None, out: torch.Tensor | None = None) -> QuantizedTensor:
    """A 2-D quantized tensor as its blocks, read off the memory map into the kernels' own memory
    (`out`, a joined buffer's rows, where given; rows reordered whole where llama.cpp permuted
    them), the mapped pages then released."""
    cols = int(tensor.shape[0])
    try:
        data = tensor.data  # [rows, bytes per row] on the map: read once, into the kernels' layout
        if heads is not None:
            data = _undo_qk_permutation(data, heads)
        read = (lambda begin, end: reader.release(tensor, begin, end)) if heads is None else None
        weight = QuantizedTensor(tensor.tensor_type.name, data, cols, read, out)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {e}") from None
    if heads is not None:  # the reordered copy read it whole
        reader.release(tensor)
    return weight


def _quantized_experts(path: str, reader, tensor, outs: list[torch.Tensor] | None = None) -> ExpertWeights:
    """A stacked [experts, rows, cols] quantized tensor (llama.cpp's `*_exps`) as one QuantizedTensor
    per expert, read off the memory map (`outs`: each expert's rows in a buffer it shares, where given)."""
    cols = int(tensor.shape[0])
    try:
        data = tensor.data  # [experts, rows, bytes per row] on the map
        each = data[0].nbytes
        parts = [
            QuantizedTensor(
                tensor.tensor_type.name,
                data[e],
                cols,
                lambda begin, end, at=e * each: reader.release(tensor, at + begin, at + end),
                None if outs is None else outs[e],
            )
            for e in range(data.shape[0])
        ]
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {e}") from None
    return ExpertWeights(parts)


# a layer's stacked experts the model joins per expert (MoE: gate rows, then up rows)
JOINED_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")


def expert_join_plan(tensors, kinds) -> dict[str, tuple[str, int, int]]:
    """Tensor name -> (its layer's gate tensor name, its first row in each expert's buffer, the
    buffer's rows) for each layer whose stacked gate and up experts are of one quantized type (of
    `kinds`) and width, the gate's rows whole 16-row groups: each expert's gate and up are then read
    into one buffer, and the model's join of them (QuantizedTensor.cat) is a view, not a copy of
    every expert made while the parts are still held (a load peak of a layer's gate and up experts)."""
    by_name = {t.name: t for t in tensors}
    plan = {}
    for t in tensors:
        if not t.name.endswith("." + JOINED_EXPERTS[0]):
            continue
        up = by_name.get(t.name[: -len(JOINED_EXPERTS[0])] + JOINED_EXPERTS[1])
        if (
            up is None
            or t.data.ndim != 3
            or up.data.ndim != 3
            or t.tensor_type.name not in kinds
            or (t.tensor_type, t.data.shape[0], t.data.shape[2]) != (up.tensor_type, up.data.shape[0], up.data.shape[2])
            or t.data.shape[1] % 16
        ):
            continue
        rows = int(t.data.shape[1] + up.data.shape[1])
        plan[t.name], plan[up.name] = (t.name, 0, rows), (t.name, int(t.data.shape[1]), rows)
    return plan


def _classifier_labels(path: str, meta: dict, reader) -> list[str] | None:
    """A reranker file's output head: llama.cpp's converter writes a Qwen3-Reranker's lm_head rows of
    its labels ("yes", "no") as `cls.output.weight` and no `output.weight`. The labels of its rows
    (`{arch}.classifier.output_labels`, in the file's order); None where the file has no such head."""
    head = next((t for t in reader.tensors if t.name == "cls.output.weight"), None)
    if head is None:
        return None
    key = f"{meta.get('general.architecture')}.classifier.output_labels"
    labels = meta.get(key)
    rows = int(head.shape[-1])  # GGUF lists dims fastest first: [hidden, rows]
    if len(head.shape) != 2 or not (
        isinstance(labels, list) and len(labels) == rows and all(isinstance(x, str) for x in labels)
    ):
        raise ModelLoadError(
            f"{path}: {key} = {labels!r}: the classifier head cls.output.weight (shape "
            f"{tuple(int(d) for d in reversed(head.shape.tolist()))}) needs one label per row"
        )
    return labels


def load_gguf(path: str) -> ModelFiles:
    # most quantized tensors repacked while the engine core imported torch
    prefetched = gguf_prefetch.take(path)
    packed = prefetched.packed if prefetched is not None else {}
    prejoined = prefetched.joined if prefetched is not None else {}
    reader = open_gguf(path, skip=UNREAD_AT_LOAD)  # (a 151K-token vocabulary's merges: ~0.06 s)
    meta = reader.metadata
    names = {t.name for t in reader.tensors}
    config = _config_from_metadata(path, meta, names)
    config.head_labels = _classifier_labels(path, meta, reader)
    if config.head_labels is not None:
        config.tie_word_embeddings = False
    family = resolve_model_class(config.architecture)
    # the engine core's: built if a request needs the vocabulary, reading the lists skipped above
    tokenizer = tokenizer_from_gguf(path, meta, lazy=True, unread=reader.skipped)

    weights: dict[str, torch.Tensor | QuantizedTensor | DeferredWeight] = {}
    # q/k/v and gate/up read into one buffer each (QuantizedTensor.cat's join is then a view)
    plan = gguf_prefetch.join_plan(reader.tensors, QuantizedTensor.KINDS) if quant.available() else {}
    buffers: dict[str, tuple[torch.Tensor, bool]] = {}  # Joint.key -> (its buffer, filled by the prefetch)
    expert_plan = expert_join_plan(reader.tensors, QuantizedTensor.KINDS) if quant.available() else {}
    expert_buffers: dict[str, list[torch.Tensor]] = {}  # a layer's gate name -> each expert's buffer
    for tensor in reader.tensors:
        if tensor.name == "output.weight" and config.head_labels is not None:
            continue  # the classifier is the head a rank-pooled file runs (as llama.cpp does)
        if tensor.name == "rope_freqs.weight":
            # Llama-3 style scaling stored as per-frequency divisors.
            factors = _dequantize(path, tensor).reshape(-1)
            dim = family.rope_freqs_head_dim(config)
            if factors.shape[0] != dim // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
                raise ModelLoadError(
                    f"{path}: tensor rope_freqs.weight: expected {dim // 2} finite positive factors, "
                    f"found {factors.shape[0]}"
                )
            config.rope.freq_factors = family.rope_factors(factors.tolist())
            continue
        if tensor.name in LONGROPE_TENSORS:
            # Phi-3's longrope: per-frequency divisors within / beyond the original context
            rotated = config.rope.rotary_dim or config.head_dim
            factors = _dequantize(path, tensor).reshape(-1)
            if factors.shape[0] != rotated // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
                raise ModelLoadError(
                    f"{path}: tensor {tensor.name}: expected {rotated // 2} finite positive factors, "
                    f"found {factors.shape[0]}"
                )
            setattr(config.rope, LONGROPE_TENSORS[tensor.name], factors.tolist())
            config.rope.scaling_type = "longrope"
            continue
        hf = hf_name(path, tensor.name, family.gguf_layer_tensors)
        _check_supported(path, tensor)  # at load, though the data is decoded later
        heads = None
        if family.gguf_permuted_qk:  # llama.cpp permuted Q and K rows for its RoPE layout: undone
            if tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
                heads = config.num_heads
            elif tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
                heads = config.num_kv_heads
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        joint = plan.get(tensor.name)
        if joint is not None:
            if joint.key not in buffers:
                ready = prejoined.pop(joint.key, None)
                buffer = (
                    torch.from_numpy(ready)
                    if ready is not None
                    else torch.empty((joint.rows, joint.row_bytes), dtype=torch.uint8)
                )
                buffers[joint.key] = buffer, ready is not None
            buffer, ready = buffers[joint.key]
            row = joint.first_row[tensor.name]
            rows = buffer[row : row + shape[0]]
            if ready:  # packed by the prefetch, beside torch's import
                weights[hf] = QuantizedTensor.from_packed(tensor.tensor_type.name, rows, int(tensor.shape[0]))
            else:
                weights[hf] = _quantized_weight(path, reader, tensor, heads, rows)
        elif tensor.name in packed and heads is None:
            weights[hf] = QuantizedTensor.from_packed(
                tensor.tensor_type.name, torch.from_numpy(packed.pop(tensor.name)), int(tensor.shape[0])
            )
        elif tensor.tensor_type.name in QuantizedTensor.KINDS and len(shape) == 2 and quant.available():
            weights[hf] = _quantized_weight(path, reader, tensor, heads)  # held at the file's bits
        elif tensor.tensor_type.name in QuantizedTensor.KINDS and len(shape) == 3 and quant.available():
            outs = None
            if tensor.name in expert_plan:  # gate and up rows of each expert in one buffer
                gate, first, rows = expert_plan[tensor.name]
                experts, _, row_bytes = tensor.data.shape
                if gate not in expert_buffers:
                    expert_buffers[gate] = [torch.empty((rows, row_bytes), dtype=torch.uint8) for _ in range(experts)]
                outs = [buffer[first : first + shape[1]] for buffer in expert_buffers[gate]]
            # [experts, rows, cols], each expert at the file's bits
            weights[hf] = _quantized_experts(path, reader, tensor, outs)
        else:
            shape = tuple(family.gguf_tensor_shape(hf, shape))  # the HF layout's (a mixer's [heads, 1] A is [heads])
            weights[hf] = DeferredWeight(
                lambda t=tensor, h=heads, n=hf, s=shape: _float_weight(path, reader, t, h, n, family).reshape(s), shape
            )
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError(f"{path}: tensor token_embd.weight: missing")
    if config.rope.scaling_type == "longrope" and (config.rope.long_factor is None or config.rope.short_factor is None):
        missing = "rope_factors_long.weight" if config.rope.long_factor is None else "rope_factors_short.weight"
        raise ModelLoadError(f"{path}: tensor {missing}: missing (longrope needs both factor tensors)")
    config.vocab_size = weights["model.embed_tokens.weight"].shape[0]
    return ModelFiles(config, weights, tokenizer)
