"""One Llama-style decoder for Llama / SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm).

It runs a flattened batch: every token of every scheduled request in one [T, hidden] tensor;
attention alone looks at request boundaries, through `AttentionMetadata`.
"""

import os

import torch
import torch.nn.functional as F

from treadle.model.config import ModelConfig, ModelLoadError
from treadle.model.families.interface import CausalLM
from treadle.model.kernels.quant import QuantizedTensor, quant_rows_op
from treadle.model.layers.attention import AttentionMetadata, metadata_by_layer, paged_attention
from treadle.model.layers.linear import LORA_ROWS, Linear
from treadle.model.layers.moe import MoE, moe_shapes
from treadle.model.layers.norm import RMSNorm
from treadle.model.layers.rotary import RotaryEmbedding, apply_rotary


class LayerWeights:
    """Takes one decoder layer's weights (HF names after `prefix`) off the loader's dict, each in
    the form the model keeps: norms through the family's `norm` (its convention for the weight)."""

    def __init__(self, w: dict, prefix: str, dtype: torch.dtype, device, norm, index: int = 0):
        self.w, self.prefix, self.dtype, self.device, self.norm_of = w, prefix, dtype, device, norm
        self.index = index  # the layer's number

    def take(self, name: str) -> torch.Tensor:
        key = self.prefix + name
        if key not in self.w:
            raise ModelLoadError(f"weight {key}: missing")
        return self.w.pop(key).to(device=self.device, dtype=self.dtype)

    def norm(self, name: str) -> RMSNorm:
        key = self.prefix + name
        if key not in self.w:
            raise ModelLoadError(f"weight {key}: missing")
        return self.norm_of(self.w.pop(key))

    def take_float(self, name: str) -> torch.Tensor:
        """A small parameter in float32, whatever the model's dtype (a state-space layer's A, D, dt bias)."""
        key = self.prefix + name
        if key not in self.w:
            raise ModelLoadError(f"weight {key}: missing")
        return self.w.pop(key).float().to(self.device)

    def take_part(self, name: str):
        """A matrix in its stored form (a file's quantized blocks as they are)."""
        return weight_part(self.w, self.prefix + name, self.dtype, self.device)

    def linear(self, names, bias=None) -> Linear:
        """One Linear over the concatenation of these weights, each in its stored form."""
        parts = [self.take_part(n) for n in names]
        linear = Linear(parts, bias)
        linear.sources = [((self.prefix + n).removesuffix(".weight"), p.shape[0]) for n, p in zip(names, parts)]
        return linear


class DecoderLayer:
    # a sparse layer's feed-forward: the experts (moe.py), under these names (MoE's defaults: Qwen's)
    moe: MoE | None = None
    moe_names: dict = {}

    def __init__(self, config: ModelConfig, lw: LayerWeights):
        take, linear = lw.take, lw.linear
        self.input_norm = lw.norm("input_layernorm.weight")
        self.post_attention_norm = lw.norm("post_attention_layernorm.weight")
        # q, k, v in one projection and gate, up in another: one matrix product each.
        qkv_names = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat(
                [take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"), take("self_attn.v_proj.bias")]
            )
        self.qkv = linear(qkv_names, qkv_bias)
        self.q_norm = lw.norm("self_attn.q_norm.weight") if config.qk_norm else None
        self.k_norm = lw.norm("self_attn.k_norm.weight") if config.qk_norm else None
        self.o_proj = linear(("self_attn.o_proj.weight",))
        if config.moe is not None and config.moe.sparse(lw.index):
            self.moe = MoE(config, lw, **self.moe_names)
            self.gate_up = self.down = None
        else:
            self.gate_up = linear(("mlp.gate_proj.weight", "mlp.up_proj.weight"))
            self.down = linear(("mlp.down_proj.weight",))


def weight_part(w: dict, key: str, dtype: torch.dtype, device):
    """A matrix weight as the model keeps it: a file's quantized blocks as they are (the CPU
    kernels use them directly), anything else in the model's dtype."""
    if key not in w:
        raise ModelLoadError(f"weight {key}: missing")
    weight = w.pop(key)
    if isinstance(weight, QuantizedTensor) and torch.device(device).type == "cpu":
        return weight
    return weight.to(device=device, dtype=dtype)


# A prompt step's MLP runs over at most this many rows at a time where that changes no bit
# (Linear.rows_apart), so its [rows, 2 x intermediate] product stays small: a 2,048-token step of a
# 1B model held 64 MB there, and the step's other transients as much again.
FFN_ROWS = 256


def in_row_slices(fn, x: torch.Tensor, linears) -> torch.Tensor:
    """fn(x) for a row-wise fn using these Linears, computed FFN_ROWS rows at a time where each
    Linear gives the same bits that way (not under torch.compile, nor with LoRA rows in the step)."""
    if torch.compiler.is_compiling():  # first: a test of the row count would guard a dynamic-shape graph on it
        return fn(x)
    n = x.shape[0]
    if n <= FFN_ROWS or LORA_ROWS.groups or not all(lin.rows_apart(FFN_ROWS) for lin in linears):
        return fn(x)
    out = None
    for start in range(0, n, FFN_ROWS):
        part = fn(x[start : start + FFN_ROWS])
        if out is None:
            out = part.new_empty((n, *part.shape[1:]))
        out[start : start + FFN_ROWS] = part
    return out


ROPE_TABLE_CAP = 1 << 17  # positions, when no engine says how many it uses


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama-style decoder with this config reads, and its shape (HF names)."""
    h, q, kv, ff = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (len(config.head_labels) if config.head_labels else config.vocab_size, h),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
        }  # fmt: skip
        if config.attention_bias:
            layer.update(
                {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
            )
        if config.qk_norm:
            q_norm, k_norm = (config.head_dim, config.head_dim) if config.qk_norm_per_head else (q, kv)
            layer.update({"self_attn.q_norm.weight": (q_norm,), "self_attn.k_norm.weight": (k_norm,)})
        shapes.update({p + k: v for k, v in layer.items()})
        if config.moe is not None and config.moe.sparse(i):
            moe_shapes(config, i, shapes, p)
    return shapes


def check_weight_shapes(shapes: dict[str, tuple[int, ...]], weights: dict) -> None:
    """Each weight present has the shape the config implies (`shapes`; a missing or extra one is
    reported where it is taken); before any is converted, so a file whose tensors contradict its
    own hyperparameters is a load error, not a failure in the first forward."""
    for name, shape in shapes.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"weight {name}: shape {tuple(weights[name].shape)}, expected {shape} from the model's configuration"
            )


class LlamaModel(CausalLM):
    hf_model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architectures = ("llama",)

    provides_hidden_states = True
    gguf_permuted_qk = True  # llama.cpp's converter permutes Q and K of "llama" files
    # SmolVLM / Idefics3 as llama.cpp ships them: the text model's GGUF and an mmproj file beside it
    # (`vision_from_mmproj`); any family whose residual stream places the images takes one
    mmproj_projectors = ("idefics3",)
    # The MLP's gate activation, act(gate) * up; a subclass may replace it (read once per step).
    mlp_activation = staticmethod(F.silu)

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device="cpu",
        batch_invariant: bool = False,
    ):
        self.config = config
        self.dtype = dtype
        # batch_invariant: a dense matrix product in calls of at most Linear.INVARIANT_ROWS rows (a
        # kernel's rounding must not depend on how many rows share the step); quantized weights'
        # kernels compute a row the same way for any number of rows.
        # Consumes `weights`: each float32 tensor is freed as soon as its converted copy exists, so
        # loading never holds two full copies of the model.
        self.device = device
        w = weights
        check_weight_shapes(self.expected_shapes(config), w)
        if "model.embed_tokens.weight" not in w or "model.norm.weight" not in w:
            missing = "model.embed_tokens.weight" if "model.embed_tokens.weight" not in w else "model.norm.weight"
            raise ModelLoadError(f"weight {missing}: missing")
        self.embed = weight_part(w, "model.embed_tokens.weight", dtype, device)
        self.norm = self.make_norm(w.pop("model.norm.weight"))
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = Linear(self.embed if tied else weight_part(w, "lm_head.weight", dtype, device))
        w.pop("lm_head.weight", None)
        self.layers = [
            self.layer_class(config, LayerWeights(w, f"model.layers.{i}.", dtype, device, self.make_norm, i))
            for i in range(config.num_layers)
        ]
        if batch_invariant:
            for linear in self.linears():
                linear.row_chunk = Linear.INVARIANT_ROWS
            for layer in self.layers:
                if layer.moe is not None:
                    layer.moe.row_chunk = Linear.INVARIANT_ROWS
        w.pop("model.rotary_emb.inv_freq", None)
        if w:
            raise ModelLoadError(f"weight {sorted(w)[0]}: unexpected for architecture {config.architecture}")
        if config.mmproj is not None and self.vision is None:
            self.vision = self.vision_from_mmproj(config.mmproj)
        self.rotary = self.rotary_for(config.rope)
        self.layer_groups = [g for g, _ in config.kv_layout().layer_slots()]  # each layer's cache group
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    # ---------------------------------------------------------------- what a family may change
    layer_class = DecoderLayer

    def vision_from_mmproj(self, path: str):
        """The image encoder of llama.cpp's mmproj file at `path` (config.mmproj, whose projector is
        one of `mmproj_projectors`)."""
        from treadle.model.families.idefics3_vision import Idefics3Vision
        from treadle.model.layers.mmproj import WHERE
        from treadle.model.loading.gguf_file import open_gguf

        vision = Idefics3Vision.from_gguf(open_gguf(path), self.dtype, self.device)
        if vision.text_hidden_size != self.config.hidden_size:
            raise ModelLoadError(
                f"{WHERE} {path}: its projection gives {vision.text_hidden_size}-wide embeddings; "
                f"the model's hidden size is {self.config.hidden_size}"
            )
        return vision

    def encode_image(self, pixels: torch.Tensor, extra: dict) -> torch.Tensor:
        return self.vision.encode(pixels.to(self.device)).flatten(0, 1)  # [tiles, tokens, hidden]: tiles in order

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return expected_shapes(config)

    def make_norm(self, weight) -> RMSNorm:
        """An RMSNorm from its stored weight (Llama's convention: the weight multiplies)."""
        return RMSNorm(weight.to(device=self.device, dtype=self.dtype), self.config.rms_norm_eps)

    def rotary_for(self, rope, head_dim: int | None = None) -> RotaryEmbedding:
        """Rotary tables covering the positions the engine uses (its max_model_len, `position_table`;
        the same size in the compiler's process as in the engine's: graphs see it), else the
        model's context (a file's claim capped)."""
        cfg = self.config
        positions = cfg.position_table or min(cfg.max_position, ROPE_TABLE_CAP)
        return RotaryEmbedding(rope, head_dim or cfg.head_dim, positions).to(self.device)

    def linears(self) -> list[Linear]:
        out = [self.lm_head]
        for layer in self.layers:
            out += [layer.qkv, layer.o_proj] + (
                layer.moe.linears() if layer.moe is not None else [layer.gate_up, layer.down]
            )
        return out

    def other_forms(self) -> list[tuple[torch.Tensor, str]]:
        return [form for layer in self.layers if layer.moe is not None for form in layer.moe.stored_forms()]

    def tensors(self) -> list[torch.Tensor]:
        norms = [
            n
            for layer in self.layers
            for n in (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm)
            if n is not None
        ]
        return [self.embed, self.norm.weight2] + [n.weight2 for n in norms]

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, kv_caches, meta: AttentionMetadata | list[AttentionMetadata], logits_indices
    ) -> torch.Tensor:
        return self.logits(self.norm(self.residual_stream(input_ids, positions, kv_caches, meta)[logits_indices]))

    def hidden_states(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.norm(self.residual_stream(input_ids, positions, kv_caches, meta))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logit_transform(self.lm_head.float_output(hidden))

    def logit_transform(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the head's output, elementwise (a soft cap, a scale)."""
        return logits

    def greedy_head(self) -> bool:
        # (a family that computes its forward or logits its own way, a plugin's, takes the logits)
        cls = type(self)
        if cls.forward is not LlamaModel.forward or cls.logits is not LlamaModel.logits:
            return False
        return self.lm_head.argmax_ready(self.dtype)

    def greedy_forward(self, input_ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        hidden = self.norm(self.residual_stream(input_ids, positions, kv_caches, meta)[logits_indices])
        return self.lm_head.argmax_output(hidden, self.logit_transform)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedTensor):
            if torch.compiler.is_compiling():
                return quant_rows_op(self.embed.data, self.embed.type_id, self.embed.shape[1], input_ids, self.dtype)
            return self.embed.rows(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    def residual_stream(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Every decoder layer over the step's T tokens: the residual stream before the final norm."""
        h = self.place_images(self.embedding(input_ids))  # a fresh tensor: the residual adds below are in place
        tables = self.rotary.tables(positions)  # once per step, shared by every layer
        metas = metadata_by_layer(meta, self.layer_groups)
        if self.layers_in_c(h, tables, kv_caches, metas):
            return h
        for layer, kv, layer_meta in zip(self.layers, kv_caches, metas):
            h += self.attention(layer, layer.input_norm(h), tables, kv, layer_meta)
            h += self.feed_forward(layer, layer.post_attention_norm(h))
        return h

    _stepper = False  # not yet decided
    decoder_kernel = True  # residual_stream's layers are kernels/decoder.py's (where the model qualifies)

    def layer_stepper(self):
        """The C path of this model's layers (kernels/decoder.py), or None where the model does not
        qualify or TREADLE_DECODER_KERNEL=0; decided on the first step."""
        if self._stepper is False:
            from treadle.model.kernels.decoder import LayerStepper

            self._stepper = (
                LayerStepper.for_model(self) if os.environ.get("TREADLE_DECODER_KERNEL", "1") != "0" else None
            )
        return self._stepper

    def layers_in_c(self, h: torch.Tensor, tables, kv_caches, metas, local_tables=None) -> bool:
        """Every layer over `h` in place on the C path (two calls each, the same bits), where the
        model and this step allow; False, having done nothing, otherwise (`LayerStepper.run`)."""
        if torch.compiler.is_compiling():
            return False
        stepper = self.layer_stepper()
        return stepper is not None and stepper.run(h, tables, kv_caches, metas, FFN_ROWS, local_tables)

    @staticmethod
    def stepper_norms(layer) -> tuple:
        """A layer's norms as the C path takes them: before the attention, before the MLP, and on
        the attention's and the MLP's outputs before each is added (None: not normed)."""
        return layer.input_norm, layer.post_attention_norm, None, None

    def attention(self, layer, x: torch.Tensor, tables, kv, layer_meta: AttentionMetadata) -> torch.Tensor:
        """One layer's attention over the normed stream `x` [T, hidden]: q, k, v, their norms,
        rotary embeddings, paged attention (writing this step's K/V), the output projection."""
        cfg = self.config
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        t = x.shape[0]
        qk, v = layer.qkv(x).split_with_sizes([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if layer.q_norm is not None and not cfg.qk_norm_per_head:  # OLMoE: over all heads at once
            qk = torch.cat([layer.q_norm(qk[:, : self.q_size]), layer.k_norm(qk[:, self.q_size :])], dim=1)
        if cfg.clip_qkv is not None:  # after OLMoE's norms, as transformers clamps
            qk, v = qk.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        qk = qk.view(t, heads + kv_heads, cfg.head_dim)
        v = v.view(t, kv_heads, cfg.head_dim)
        if layer.q_norm is not None and cfg.qk_norm_per_head:
            qk = torch.cat([layer.q_norm(qk[:, :heads]), layer.k_norm(qk[:, heads:])], dim=1)
        if tables is not None:  # None: no position embedding (NoPE layers)
            qk = apply_rotary(qk, *tables)  # q and k rotated together
        q, k = qk.split_with_sizes([heads, kv_heads], dim=1)
        attn = paged_attention(q, k, v, kv[0], kv[1], layer_meta, self.scale)
        return layer.o_proj(attn.view(t, self.q_size))

    def feed_forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        """One layer's MLP, or its experts, over the normed stream `x`."""
        if layer.moe is not None:
            return layer.moe(x)
        return in_row_slices(lambda rows: self.mlp(layer, rows), x, (layer.gate_up, layer.down))

    def mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(self.mlp_activation(gate) * up)


class MistralModel(LlamaModel):
    """Mistral: a Llama whose layers may attend within a sliding window (config.json's
    `sliding_window`; llama.cpp writes these files as "llama")."""

    hf_model_types = ("mistral",)
    hf_architectures = ("MistralForCausalLM",)
    gguf_architectures = ()  # llama.cpp writes Mistral files as "llama"


class Qwen2Model(LlamaModel):
    """Qwen2: bias on q, k and v; config.json's sliding window only with `use_sliding_window`."""

    hf_model_types = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_architectures = ("qwen2",)

    gguf_permuted_qk = False

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return hf.checked(hf.llama_style(attention_bias=True, sliding_window=window or None))


class Qwen3Model(Qwen2Model):
    """Qwen3: RMSNorm on each head of q and k, no q/k/v bias."""

    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architectures = ("qwen3",)

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return hf.checked(hf.llama_style(qk_norm=True, sliding_window=window or None))
