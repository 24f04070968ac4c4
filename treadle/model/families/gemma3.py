"""Gemma 3 (the text model): Llama's decoder with Gemma's changes.

- local and global layers: every `sliding_window_pattern`-th layer (6: layers 5, 11, ...) attends
  to every position, the others within a sliding window; each kind has its own RoPE base (10,000
  local, 1,000,000 global, where linear scaling may apply) and its own cache group, so the local
  layers' KV of positions out of their window is freed (kv_layout.py);
- four norms per layer (before and after attention, before and after the MLP), RMSNorm on each
  head of q and k; Gemma's RMSNorm multiplies by (1 + weight): the weight is stored as 1 + w in
  float32 at load (llama.cpp's GGUF files already hold 1 + w; `from_gguf_tensor` takes it back
  to the Hugging Face convention, which the model then follows for both sources);
- GeGLU MLP (tanh-approximated GELU of the gate, times up); embeddings scaled by sqrt(hidden),
  rounded to the model's dtype as transformers does; attention scaled by query_pre_attn_scalar^-1/2;
- optional soft-capping (Gemma 2's; None in Gemma 3) of the attention scores and of the final
  logits: cap * tanh(x / cap). Gemma 2 (gemma2.py) is this model without the q/k norms, with one
  RoPE base and every other layer local.
"""

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treadle.model.config import LIMITS, ModelConfig, ModelLoadError, RopeConfig, file_float, file_int
from treadle.model.families.gemma3_vision import Gemma3Vision
from treadle.model.families.llama import DecoderLayer, LayerWeights, LlamaModel, expected_shapes, in_row_slices
from treadle.model.layers.attention import metadata_by_layer, paged_attention
from treadle.model.layers.norm import RMSNorm
from treadle.model.layers.rotary import apply_rotary
from treadle.model.loading.gguf_file import open_gguf
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

SLIDING_WINDOW_PATTERN = 6  # transformers' default and llama.cpp's fixed value for gemma3 files
LOCAL_ROPE_THETA = 10000.0


@dataclass
class Gemma3Config(ModelConfig):
    local_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=LOCAL_ROPE_THETA))
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # a Gemma3ForConditionalGeneration folder's config.json (its vision tower's settings), None for
    # a text model; the model then sees (gemma3_vision.py)
    multimodal: dict | None = None


def layer_windows(
    num_layers: int, window: int | None, pattern: int = SLIDING_WINDOW_PATTERN, types=None
) -> list[int | None]:
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window if (i + 1) % pattern else None for i in range(num_layers)]


class Gemma3Layer(DecoderLayer):
    def __init__(self, config: ModelConfig, lw: LayerWeights):
        super().__init__(config, lw)
        self.pre_feedforward_norm = lw.norm("pre_feedforward_layernorm.weight")
        self.post_feedforward_norm = lw.norm("post_feedforward_layernorm.weight")


class Gemma3Model(LlamaModel):
    hf_model_types = ("gemma3_text", "gemma3")
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    gguf_architectures = ("gemma3",)

    layer_class = Gemma3Layer
    gguf_permuted_qk = False
    mlp_activation = staticmethod(functools.partial(F.gelu, approximate="tanh"))
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }

    # ---------------------------------------------------------------- reading its files

    @classmethod
    def config_from_hf(cls, hf) -> Gemma3Config:
        multimodal = None
        if "text_config" in hf.cfg or "vision_config" in hf.cfg:  # a model that sees: its text model's config
            multimodal = hf.cfg
            hf = type(hf)(
                hf.folder, {**hf.section("text_config"), "architectures": hf.cfg.get("architectures")}, hf.arch
            )
        cls._check_activation(hf)
        params = hf.section("rope_parameters")
        if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one entry per layer type
            global_rope = hf.rope(params.get("full_attention") or {}, default_theta=1e6)
            local_rope = hf.rope(params.get("sliding_attention") or {}, default_theta=LOCAL_ROPE_THETA)
        else:  # rope_theta, rope_local_base_freq, rope_scaling (global layers only)
            global_rope = hf.rope({"rope_theta": hf.get("rope_theta", 1e6), **hf.section("rope_scaling")})
            local_rope = RopeConfig(theta=hf.get("rope_local_base_freq", LOCAL_ROPE_THETA))
        config = cls._gemma_style(hf, SLIDING_WINDOW_PATTERN, rope=global_rope, local_rope=local_rope, qk_norm=True)
        config.multimodal = multimodal
        return cls._checked(hf.where, hf.checked(config))

    @staticmethod
    def _check_activation(hf) -> None:
        activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ModelLoadError(f"{hf.where}: hidden_activation = {activation!r}: expected gelu_pytorch_tanh")

    @staticmethod
    def _gemma_style(hf, default_pattern: int, **fields) -> Gemma3Config:
        """The fields Gemma 2 and 3 config.json files share (layer kinds, the query scale, soft-capping)."""
        num_layers = hf.int("num_hidden_layers", "num_layers")
        window = hf.get("sliding_window") or None
        types = hf.get("layer_types")
        if types is not None and (
            not isinstance(types, list)
            or len(types) != num_layers
            or not all(t in ("sliding_attention", "full_attention") for t in types)
        ):
            raise ModelLoadError(
                f"{hf.where}: layer_types: expected {num_layers} of 'sliding_attention' / 'full_attention'"
            )
        pattern = hf.get("sliding_window_pattern", default_pattern)
        return hf.llama_style(
            Gemma3Config,
            head_dim=hf.get("head_dim", 256),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_windows=layer_windows(num_layers, window, pattern, types) if window else None,
            sliding_window=None,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            **fields,
        )

    @classmethod
    def config_from_gguf(cls, gguf) -> Gemma3Config:
        local_rope = RopeConfig(theta=gguf.get("rope.freq_base_swa", LOCAL_ROPE_THETA))
        # llama.cpp: the query scale is 1/sqrt(head_dim), except Gemma 3 27B's (62 layers): 1/sqrt(hidden / heads)
        return cls._gguf_gemma_style(gguf, SLIDING_WINDOW_PATTERN, layers_scaled_by_width=62, local_rope=local_rope)

    @classmethod
    def _gguf_gemma_style(cls, gguf, default_pattern: int, layers_scaled_by_width: int, **fields) -> Gemma3Config:
        window = gguf.get("attention.sliding_window") or None
        num_layers = gguf.number("block_count", *LIMITS["num_layers"], required=True)
        pattern = gguf.get("attention.sliding_window_pattern", default_pattern)
        config = gguf.llama_style(
            Gemma3Config,
            layer_windows=layer_windows(num_layers, window, pattern)
            if window and isinstance(num_layers, int) and isinstance(pattern, int)
            else None,
            sliding_window=None,
            final_logit_softcapping=gguf.get("final_logit_softcapping"),
            attn_logit_softcapping=gguf.get("attn_logit_softcapping"),
            **fields,
        )
        config = gguf.checked(config)
        wide = config.num_layers == layers_scaled_by_width
        config.query_pre_attn_scalar = config.hidden_size / config.num_heads if wide else config.head_dim
        return cls._checked(gguf.path, config)

    @staticmethod
    def _checked(where: str, config: Gemma3Config) -> Gemma3Config:
        config.query_pre_attn_scalar = file_float(where, "query_pre_attn_scalar", config.query_pre_attn_scalar)
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, key) is not None:
                cap = file_float(where, key, getattr(config, key))
                if not cap > 0:
                    raise ModelLoadError(f"{where}: {key} = {cap}: expected a positive number")
                setattr(config, key, cap)
        config.local_rope.theta = file_float(where, "rope local base frequency", config.local_rope.theta)
        if config.layer_windows is not None:
            config.layer_windows = [
                None if w is None else file_int(where, "sliding_window", w, *LIMITS["sliding_window"])
                for w in config.layer_windows
            ]
        return config

    @staticmethod
    def from_gguf_tensor(name: str, data: np.ndarray) -> np.ndarray:
        # llama.cpp's converter stores Gemma's norm weights as 1 + w
        return data - np.float32(1.0) if name.endswith("norm.weight") else data

    # ---------------------------------------------------------------- the model

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "pre_feedforward_layernorm.weight"] = (config.hidden_size,)
            shapes[p + "post_feedforward_layernorm.weight"] = (config.hidden_size,)
        return shapes

    def __init__(
        self, config: Gemma3Config, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        vision = {}  # a model that sees: its image encoder's tensors, and the text model's under its own names
        for name in list(weights):
            if Gemma3Vision.is_vision_tensor(name):
                vision[name] = weights.pop(name)
            elif name.startswith(("model.language_model.", "language_model.")):
                text_name = name.removeprefix("model.language_model.").removeprefix("language_model.")
                weights[text_name if text_name.startswith(("model.", "lm_head.")) else "model." + text_name] = (
                    weights.pop(name)
                )
        if config.multimodal is not None:
            self.vision = Gemma3Vision.from_hf(config.multimodal, vision.pop, list(vision), dtype, device)
        super().__init__(config, weights, dtype, device, batch_invariant)
        self.local_rotary = self.rotary if config.local_rope == config.rope else self.rotary_for(config.local_rope)
        self.windows = config.windows()
        self.scale = config.query_pre_attn_scalar**-0.5
        # transformers multiplies the embedding by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=dtype, device=device)

    mmproj_projectors = ("gemma3",)  # llama.cpp's mmproj files of Gemma 3

    def vision_from_mmproj(self, path: str) -> Gemma3Vision:
        return Gemma3Vision.from_gguf(open_gguf(path), self.dtype, self.device)

    # an image's soft tokens attend to each other both ways (transformers' token_type_ids mask)
    bidirectional_images = True

    def make_norm(self, weight) -> RMSNorm:
        """Gemma's RMSNorm multiplies by 1 + weight (formed in float32, then in the model's dtype)."""
        return RMSNorm((1.0 + weight.float()).to(device=self.device, dtype=self.dtype), self.config.rms_norm_eps)

    def tensors(self) -> list[torch.Tensor]:
        extra = [n.weight2 for layer in self.layers for n in (layer.pre_feedforward_norm, layer.post_feedforward_norm)]
        return super().tensors() + extra

    def logit_transform(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    decoder_kernel = True  # the C path (kernels/decoder.py) takes these layers too, with the norms below

    @staticmethod
    def stepper_norms(layer) -> tuple:
        return layer.input_norm, layer.pre_feedforward_norm, layer.post_attention_norm, layer.post_feedforward_norm

    def residual_stream(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        t = input_ids.shape[0]
        h = self.place_images(self.embedding(input_ids) * self.embed_scale)
        global_tables = self.rotary.tables(positions)
        local_tables = global_tables if self.local_rotary is self.rotary else self.local_rotary.tables(positions)
        metas = metadata_by_layer(meta, self.layer_groups)
        if self.layers_in_c(h, global_tables, kv_caches, metas, local_tables):
            return h
        for layer, (k_cache, v_cache), layer_meta, window in zip(self.layers, kv_caches, metas, self.windows):
            cos, sin = global_tables if window is None else local_tables
            qk, v = layer.qkv(layer.input_norm(h)).split_with_sizes([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(t, heads + kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :heads]), layer.k_norm(qk[:, heads:])], dim=1)
            q, k = apply_rotary(qk, cos, sin).split_with_sizes([heads, kv_heads], dim=1)
            v = v.view(t, kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, layer_meta, self.scale, cfg.attn_logit_softcapping)
            h = h + layer.post_attention_norm(layer.o_proj(attn.view(t, self.q_size)))
            mlp = functools.partial(self.mlp, layer)
            h = h + layer.post_feedforward_norm(
                in_row_slices(mlp, layer.pre_feedforward_norm(h), (layer.gate_up, layer.down))
            )
        return h
