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
"""

from dataclasses import dataclass, replace

import torch

from .attention import metadata_by_layer
from .bamba import BambaConfig, BambaLayer, BambaModel, mamba_config, mixer_shapes
from .config import ModelLoadError, MoEConfig, file_float
from .llama import LayerWeights, expected_shapes
from .moe import MoE, moe_shapes

MOE_NAMES = dict(
    router="block_sparse_moe.router.layer.weight",
    experts="block_sparse_moe",
    names=("gate_proj", "up_proj", "output_linear.weight"),
    fused_gate_up="input_linear.weight",
)
LAYER_TYPES = {"mamba": "recurrent", "linear_attention": "recurrent", "attention": "attention", "full_attention": "attention"}


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
        super().__init__(config, lw)
        self.moe = MoE(config, lw, **MOE_NAMES) if config.moe is not None else None


class GraniteHybridModel(BambaModel):
    layer_class = GraniteHybridLayer

    @classmethod
    def config_from_hf(cls, hf) -> GraniteHybridConfig:
        layers = hf.int("num_hidden_layers", "num_layers")
        types = hf.get("layer_types")
        if not isinstance(types, list) or len(types) != layers or not all(t in LAYER_TYPES for t in types):
            raise ModelLoadError(f"{hf.where}: layer_types = {types!r}: expected {layers} of {sorted(LAYER_TYPES)}")
        layer_types = [LAYER_TYPES[t] for t in types]
        if "attention" not in layer_types:
            raise ModelLoadError(f"{hf.where}: layer_types: no attention layer (a model of recurrent layers alone is not supported)")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
            raise ModelLoadError(f"{hf.where}: hidden_act / attention_bias: only silu and no bias are supported")
        experts = hf.get("num_local_experts", 0) or 0
        moe = None
        if experts:
            moe = MoEConfig(num_experts=experts, top_k=hf.need("num_experts_per_tok"), expert_size=hf.need("intermediate_size"), norm_topk=True)
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
                moe_shapes(config, i, shapes, p, router=MOE_NAMES["router"], experts="block_sparse_moe", names=MOE_NAMES["names"])
        return shapes

    def __init__(self, config: GraniteHybridConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False):
        super().__init__(config, weights, dtype, device, batch_invariant)
        self.scale = config.attention_multiplier

    def linears(self):
        return super().linears() + [x for layer in self.layers if layer.moe is not None for x in layer.moe.linears()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() / self.config.logits_scaling

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
