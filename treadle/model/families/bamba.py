"""Bamba: a hybrid of Mamba-2 mixers (mamba.py) and Llama-style attention layers (every
`attn_layer_indices` layer), each followed by a SwiGLU MLP; half of each attention head rotates
(partial rotary embeddings). IBM's Bamba and the shape Granite 4's hybrids build on.

Only the attention layers have KV (cache groups over them alone: `ModelConfig.windows`); the
mixers' states live in the runner, per request (`mamba.RecurrentState`, float32 SSM state).
"""

import math
from dataclasses import dataclass, field

import torch

from treadle.model.config import ModelConfig, ModelLoadError, file_float, file_int
from treadle.model.families.llama import DecoderLayer, LayerWeights, LlamaModel, expected_shapes
from treadle.model.layers.attention import metadata_by_layer
from treadle.model.layers.mamba import Mamba2Mixer, MambaConfig
from treadle.model.layers.recurrent import RecurrentState


def mamba_config(hf) -> MambaConfig:
    """The Mamba-2 mixers' hyperparameters as config.json gives them (mamba_* keys)."""
    hidden, heads = (
        hf.int("hidden_size", "hidden_size"),
        file_int(hf.where, "mamba_n_heads", hf.need("mamba_n_heads"), 1, 1 << 14),
    )
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = file_int(hf.where, "mamba_expand", hf.get("mamba_expand", 2), 1, 64) * hidden // heads
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    low, high = (
        (float(v) if isinstance(v, (int, float)) else math.inf for v in limit)
        if isinstance(limit, (list, tuple)) and len(limit) == 2
        else (0.0, math.inf)
    )
    mamba = MambaConfig(
        heads=heads,
        head_dim=file_int(hf.where, "mamba_d_head", head_dim, 1, 1 << 14),
        d_state=file_int(hf.where, "mamba_d_state", hf.get("mamba_d_state", 256), 1, 1 << 14),
        d_conv=file_int(hf.where, "mamba_d_conv", hf.get("mamba_d_conv", 4), 2, 64),
        groups=file_int(hf.where, "mamba_n_groups", hf.get("mamba_n_groups", 1), 1, heads),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        time_step_min=low,
        time_step_max=high,
        norm_eps=file_float(hf.where, "rms_norm_eps", hf.get("rms_norm_eps", 1e-5)),
    )
    if heads % mamba.groups:
        raise ModelLoadError(f"{hf.where}: mamba_n_groups = {mamba.groups}: does not divide mamba_n_heads = {heads}")
    return mamba


def mixer_shapes(config) -> dict[str, tuple[int, ...]]:
    """A Mamba-2 mixer's weights (under its layer's prefix) and their shapes."""
    m, h = config.mamba, config.hidden_size
    return {
        "mamba.in_proj.weight": (m.inner + m.conv_dim + m.heads, h), "mamba.out_proj.weight": (h, m.inner),
        "mamba.norm.weight": (m.inner,), "mamba.dt_bias": (m.heads,), "mamba.A_log": (m.heads,), "mamba.A": (m.heads,),
        "mamba.D": (m.heads,), "mamba.conv1d.bias": (m.conv_dim,),
    }  # fmt: skip


@dataclass
class BambaConfig(ModelConfig):
    mamba: MambaConfig = field(default_factory=lambda: MambaConfig(heads=1, head_dim=1, d_state=1, d_conv=2))

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's recurrent state in every mixer."""
        return RecurrentState.nbytes(self.mamba, self.layer_types.count("recurrent"), dtype)


class BambaLayer(DecoderLayer):
    """A mixer or an attention layer, then the MLP (a hybrid's layer; names are Bamba's)."""

    pre_mlp_norm = "pre_ff_layernorm.weight"
    mlp = (("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"), "feed_forward.down_proj.weight")

    def __init__(self, config: BambaConfig, lw: LayerWeights):
        self.input_norm = lw.norm("input_layernorm.weight")
        self.post_attention_norm = lw.norm(self.pre_mlp_norm)
        self.mixer = None
        if config.layer_types[lw.index] == "recurrent":
            self.mixer = Mamba2Mixer(config.mamba, lw, index=config.layer_types[: lw.index].count("recurrent"))
        else:
            self.qkv = lw.linear(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
            self.o_proj = lw.linear(("self_attn.o_proj.weight",))
        self.q_norm = self.k_norm = None
        self.gate_up = lw.linear(self.mlp[0])
        self.down = lw.linear((self.mlp[1],))


class BambaModel(LlamaModel):
    hf_model_types = ("bamba",)
    hf_architectures = ("BambaForCausalLM",)
    gguf_architectures = ()  # llama.cpp writes Bamba files as "granitehybrid"
    mmproj_projectors = ()  # its residual stream places no images

    layer_class = BambaLayer

    @classmethod
    def config_from_hf(cls, hf) -> BambaConfig:
        layers = hf.int("num_hidden_layers", "num_layers")
        attention = hf.get("attn_layer_indices") or []
        if (
            not isinstance(layers, int)
            or not isinstance(attention, list)
            or not all(isinstance(i, int) and 0 <= i < layers for i in attention)
        ):
            raise ModelLoadError(
                f"{hf.where}: attn_layer_indices = {attention!r}: expected layer numbers below num_hidden_layers"
            )
        if not attention:
            raise ModelLoadError(
                f"{hf.where}: attn_layer_indices: no attention layer "
                "(a model of recurrent layers alone is not supported)"
            )
        if hf.get("mlp_bias") or hf.get("attention_bias"):
            raise ModelLoadError(f"{hf.where}: mlp_bias / attention_bias: not supported")
        mamba = mamba_config(hf)
        rope = hf.rope({"partial_rotary_factor": 0.5, **(hf.section("rope_parameters") or hf.section("rope_scaling"))})
        config = hf.llama_style(
            BambaConfig,
            rope=rope,
            layer_types=["attention" if i in attention else "recurrent" for i in range(layers)],
            mamba=mamba,
        )
        return hf.checked(config)

    @staticmethod
    def expected_shapes(config: BambaConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(config)
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            for name in (
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
                "post_attention_layernorm.weight",
            ):
                shapes.pop(p + name)
            if kind == "recurrent":
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    shapes.pop(p + f"self_attn.{name}.weight")
                shapes.update({p + k: v for k, v in mixer_shapes(config).items()})
        return shapes

    def __init__(
        self, config: BambaConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        if "model.final_layernorm.weight" in weights:  # Bamba's name for the final norm
            weights["model.norm.weight"] = weights.pop("model.final_layernorm.weight")
        super().__init__(config, weights, dtype, device, batch_invariant)
        self.recurrent_layers = config.layer_types.count("recurrent")

    def new_state(self) -> RecurrentState:
        """A request's state in every mixer, zeroed (the runner makes one per request)."""
        return RecurrentState.zeros(self.config.mamba, self.recurrent_layers, self.dtype, self.device)

    def linears(self):
        out = [self.lm_head]
        for layer in self.layers:
            out += (layer.mixer.linears() if layer.mixer is not None else [layer.qkv, layer.o_proj]) + [
                layer.gate_up,
                layer.down,
            ]
        return out

    def tensors(self):
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_attention_norm, layer.q_norm,
                                                      layer.k_norm) if n is not None]  # fmt: skip
        mixers = [t for layer in self.layers if layer.mixer is not None for t in layer.mixer.tensors()]
        return [self.embed, self.norm.weight2] + [n.weight2 for n in norms] + mixers

    def residual_stream(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        h = self.embedding(input_ids)
        tables = self.rotary.tables(positions)
        segments = (meta[0] if isinstance(meta, list) else meta).recurrent
        attention = zip(kv_caches, metadata_by_layer(meta, self.layer_groups))
        for layer in self.layers:
            x = layer.input_norm(h)
            if layer.mixer is not None:
                h += layer.mixer(x, segments)
            else:
                kv, layer_meta = next(attention)
                h += self.attention(layer, x, tables, kv, layer_meta)
            h += self.feed_forward(layer, layer.post_attention_norm(h))
        return h
