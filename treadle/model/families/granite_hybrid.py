"""Granite 4 hybrids (transformers' GraniteMoeHybrid): Bamba's Mamba-2 mixers and attention
layers (mamba.py, bamba.py), with Granite's scalings and feed-forward.

- the embedding times `embedding_multiplier`, each layer's two residual branches times
  `residual_multiplier`, attention scaled by `attention_multiplier` (instead of 1/sqrt(head_dim)),
  logits divided by `logits_scaling`;
- attention without position embeddings unless `position_embedding_type` is "rope" (Granite 4.0-H
  is NoPE: the mixers carry position);
- the feed-forward: a shared SwiGLU MLP (`shared_mlp.input_linear`, gate rows then up) on every
  token, plus, where `num_local_experts` > 0, experts (moe.py; the router's softmax over its top-k
  logits, which is the top-k of the softmax renormalised) added to it.

GGUF files (llama.cpp's `granitehybrid`, which its converter writes for Granite 4 hybrids and for
Bamba alike): the layers' kinds from the per-layer KV head counts (0: a mixer), the mixers' sizes
from `ssm.*`, Granite's multipliers from `embedding_scale`, `residual_scale`, `attention.scale`
and `logit_scale` (absent: 1, and 1/sqrt(head_dim) for attention, as llama.cpp takes them), RoPE
where `rope.scaling.finetuned` says (Bamba) and none otherwise; the converter's layouts undone:
A = -exp(A_log) taken as it is, the conv kernel, D and the grouped norm reshaped, the shared MLP's
gate and up as two tensors (`ffn_gate`/`ffn_up`, or `*_shexp` beside experts).
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from treadle.model.config import LIMITS, ModelLoadError, MoEConfig, file_float, file_int
from treadle.model.families.bamba import BambaConfig, BambaLayer, BambaModel, mamba_config, mixer_shapes
from treadle.model.families.llama import LayerWeights, expected_shapes
from treadle.model.layers.attention import metadata_by_layer
from treadle.model.layers.mamba import MambaConfig
from treadle.model.layers.moe import MoE, moe_shapes
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

MOE_NAMES = dict(
    router="block_sparse_moe.router.layer.weight",
    experts="block_sparse_moe",
    names=("gate_proj", "up_proj", "output_linear.weight"),
    fused_gate_up="input_linear.weight",
)
LAYER_TYPES = {
    "mamba": "recurrent",
    "linear_attention": "recurrent",
    "attention": "attention",
    "full_attention": "attention",
}


@dataclass
class GraniteHybridConfig(BambaConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope_positions: bool = False  # position_embedding_type "rope"; else NoPE


class GraniteHybridLayer(BambaLayer):
    pre_mlp_norm = "post_attention_layernorm.weight"
    mlp = (("shared_mlp.input_linear.weight",), "shared_mlp.output_linear.weight")  # gate rows, then up

    def __init__(self, config: GraniteHybridConfig, lw: LayerWeights):
        if lw.prefix + "shared_mlp.gate.weight" in lw.w:  # a GGUF file's: gate and up apart (one product all the same)
            self.mlp = (("shared_mlp.gate.weight", "shared_mlp.up.weight"), self.mlp[1])
        super().__init__(config, lw)
        self.moe = MoE(config, lw, **MOE_NAMES) if config.moe is not None else None


class GraniteHybridModel(BambaModel):
    hf_model_types = ("granitemoehybrid",)
    hf_architectures = ("GraniteMoeHybridForCausalLM",)
    gguf_architectures = ("granitehybrid",)  # llama.cpp's name for Granite 4 and Bamba files

    layer_class = GraniteHybridLayer
    gguf_permuted_qk = True  # the converter permutes the attention layers' Q and K as for "llama"
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "ssm_in.weight": "mamba.in_proj.weight",
        "ssm_conv1d.weight": "mamba.conv1d.weight",
        "ssm_conv1d.bias": "mamba.conv1d.bias",
        "ssm_dt.bias": "mamba.dt_bias",
        "ssm_a": "mamba.A",
        "ssm_d": "mamba.D",
        "ssm_norm.weight": "mamba.norm.weight",
        "ssm_out.weight": "mamba.out_proj.weight",
        "ffn_gate.weight": "shared_mlp.gate.weight",
        "ffn_up.weight": "shared_mlp.up.weight",
        "ffn_down.weight": "shared_mlp.output_linear.weight",
        "ffn_gate_shexp.weight": "shared_mlp.gate.weight",
        "ffn_up_shexp.weight": "shared_mlp.up.weight",
        "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
        "ffn_gate_inp.weight": MOE_NAMES["router"],
        "ffn_gate_exps.weight": "block_sparse_moe.gate_proj",
        "ffn_up_exps.weight": "block_sparse_moe.up_proj",
        "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    }

    @classmethod
    def config_from_gguf(cls, gguf) -> GraniteHybridConfig:
        layers = gguf.number("block_count", *LIMITS["num_layers"], required=True)
        counts = gguf.get("attention.head_count_kv", required=True)
        if not isinstance(counts, list) or len(counts) != layers:
            raise gguf.fail(
                "attention.head_count_kv", f"expected one KV head count per layer ({layers}; 0 for a recurrent layer)"
            )
        layer_types = ["attention" if n else "recurrent" for n in counts]
        if "attention" not in layer_types or "recurrent" not in layer_types:
            raise gguf.fail("attention.head_count_kv", "expected both attention layers and recurrent ones (0)")
        first = layer_types.index("recurrent")
        heads = gguf.number("ssm.time_step_rank", 1, 1 << 14, required=True)
        inner = gguf.number("ssm.inner_size", 1, 1 << 20, required=True)
        if inner % heads:
            raise gguf.fail("ssm.inner_size", f"{inner}: not a multiple of the {heads} heads (ssm.time_step_rank)")
        mamba = MambaConfig(
            heads=heads,
            head_dim=inner // heads,
            d_state=gguf.number("ssm.state_size", 1, 1 << 14, required=True),
            d_conv=gguf.number("ssm.conv_kernel", 2, 64, required=True),
            groups=gguf.number("ssm.group_count", 1, heads, default=1),
            conv_bias=f"blk.{first}.ssm_conv1d.bias" in gguf.tensor_names,
            proj_bias=f"blk.{first}.ssm_in.bias" in gguf.tensor_names,
            norm_eps=file_float(
                gguf.path, "attention.layer_norm_rms_epsilon", gguf.get("attention.layer_norm_rms_epsilon", 1e-5)
            ),
        )
        if heads % mamba.groups:
            raise gguf.fail("ssm.group_count", f"{mamba.groups}: does not divide the {heads} heads")
        shared = gguf.get("expert_shared_feed_forward_length")
        config = gguf.llama_style(
            GraniteHybridConfig,
            partial_rotary=True,  # Bamba's: half of each head
            per_layer_kv_heads=True,
            intermediate_size=shared if shared else gguf.get("feed_forward_length", required=True),
            layer_types=layer_types,
            mamba=mamba,
            rope_positions=bool(gguf.get("rope.scaling.finetuned", False)),
        )
        if config.moe is not None:  # the shared MLP is the layer's own (no gated shared expert in the MoE)
            config.moe = replace(config.moe, shared_size=0)
        for field, key in (
            ("embedding_multiplier", "embedding_scale"),
            ("residual_multiplier", "residual_scale"),
            ("logits_scaling", "logit_scale"),
        ):
            setattr(config, field, file_float(gguf.path, f"{gguf.arch}.{key}", gguf.get(key, 1.0)))
        head_dim = file_int(gguf.path, f"{gguf.arch}.attention.key_length", config.head_dim, *LIMITS["head_dim"])
        config.attention_multiplier = file_float(
            gguf.path, f"{gguf.arch}.attention.scale", gguf.get("attention.scale") or head_dim**-0.5
        )
        return gguf.checked(config)

    @staticmethod
    def gguf_tensor_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if name.endswith("mamba.conv1d.weight") and len(shape) == 2:  # [channels, kernel] -> [channels, 1, kernel]
            return (shape[0], 1, shape[1])
        if name.endswith(("mamba.A", "mamba.D", "mamba.norm.weight")):  # [heads, 1], [groups, inner / groups]
            return (int(np.prod(shape)),)
        return shape

    @classmethod
    def config_from_hf(cls, hf) -> GraniteHybridConfig:
        layers = hf.int("num_hidden_layers", "num_layers")
        types = hf.get("layer_types")
        if not isinstance(types, list) or len(types) != layers or not all(t in LAYER_TYPES for t in types):
            raise ModelLoadError(f"{hf.where}: layer_types = {types!r}: expected {layers} of {sorted(LAYER_TYPES)}")
        layer_types = [LAYER_TYPES[t] for t in types]
        if "attention" not in layer_types:
            raise ModelLoadError(
                f"{hf.where}: layer_types: no attention layer (a model of recurrent layers alone is not supported)"
            )
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
            raise ModelLoadError(f"{hf.where}: hidden_act / attention_bias: only silu and no bias are supported")
        experts = hf.get("num_local_experts", 0) or 0
        moe = None
        if experts:
            moe = MoEConfig(
                num_experts=experts,
                top_k=hf.need("num_experts_per_tok"),
                expert_size=hf.need("intermediate_size"),
                norm_topk=True,
            )
        config = hf.llama_style(
            GraniteHybridConfig,
            intermediate_size=hf.need("shared_intermediate_size"),
            layer_types=layer_types,
            mamba=mamba_config(hf),
            moe=moe,
            rope_positions=hf.get("position_embedding_type") == "rope",
            **{
                name: file_float(hf.where, name, hf.get(name, 1.0))
                for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
            },
        )
        return hf.checked(config)

    @staticmethod
    def expected_shapes(config: GraniteHybridConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(replace(config, moe=None))  # the experts' shapes under Granite's names, below
        h, s = config.hidden_size, config.intermediate_size
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                shapes.pop(p + name)
            if kind == "recurrent":
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    shapes.pop(p + f"self_attn.{name}.weight")
                shapes.update({p + k: v for k, v in mixer_shapes(config).items()})
            shapes[p + "shared_mlp.input_linear.weight"] = (2 * s, h)
            shapes[p + "shared_mlp.output_linear.weight"] = (h, s)
            if config.moe is not None:
                moe_shapes(
                    config,
                    i,
                    shapes,
                    p,
                    router=MOE_NAMES["router"],
                    experts="block_sparse_moe",
                    names=MOE_NAMES["names"],
                )
        return shapes

    def __init__(
        self,
        config: GraniteHybridConfig,
        weights: dict,
        dtype: torch.dtype,
        device="cpu",
        batch_invariant: bool = False,
    ):
        super().__init__(config, weights, dtype, device, batch_invariant)
        self.scale = config.attention_multiplier

    def linears(self):
        return super().linears() + [x for layer in self.layers if layer.moe is not None for x in layer.moe.linears()]

    def logit_transform(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.config.logits_scaling

    def residual_stream(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        cfg = self.config
        h = self.embedding(input_ids) * cfg.embedding_multiplier
        tables = self.rotary.tables(positions) if cfg.rope_positions else None
        segments = (meta[0] if isinstance(meta, list) else meta).recurrent
        attention = zip(kv_caches, metadata_by_layer(meta, self.layer_groups))
        m = cfg.residual_multiplier
        for layer in self.layers:
            x = layer.input_norm(h)
            if layer.mixer is not None:
                out = layer.mixer(x, segments)
            else:
                kv, layer_meta = next(attention)
                out = self.attention(layer, x, tables, kv, layer_meta)
            h = h + out * m
            x = layer.post_attention_norm(h)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            out = layer.down(self.mlp_activation(gate) * up)
            if layer.moe is not None:
                out = layer.moe(x) + out
            h = h + out * m
        return h
