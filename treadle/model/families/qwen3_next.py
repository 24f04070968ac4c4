"""Qwen3-Next and Qwen3.5 / Qwen3.6: hybrids of Gated DeltaNet layers (layers/gated_deltanet.py)
and gated full-attention layers, three of the first to one of the second by default.

- the attention layer: one projection gives each head's query and, beside it, an output gate
  (q_proj's rows per head: [query (hd) | gate (hd)]); RMSNorm on each head of q and k, rotary
  embeddings on the first quarter of each head (`partial_rotary_factor`), the output times
  sigmoid(gate) before o_proj. Qwen3.5's interleaved M-RoPE reduces to this for text (its three
  position rows are equal);
- every RMSNorm multiplies by 1 + w (zero-centred weights), but the Gated DeltaNet's own output
  norm, which multiplies by w;
- the feed-forward: a SwiGLU MLP (Qwen3.5), or experts with a gated shared expert (moe.py:
  Qwen3.5-MoE / Qwen3.6 on every layer, renormalised; Qwen3-Next as `decoder_sparse_step` and
  `mlp_only_layers` say);
- Qwen3.5's released folders are the multimodal model (`Qwen3_5ForConditionalGeneration`): the
  text model's hyperparameters in `text_config`, its weights under `model.language_model.`;
  the vision tower (`model.visual.`) is not read;
- the multi-token-prediction head (`mtp.`; a GGUF file's extra `nextn` block) is kept only where the
  engine drafts with it (`--speculative-config '{"method": "mtp"}'`): `Qwen3NextMtp` below.

GGUF files as llama.cpp's converter writes them (`qwen3next`, `qwen35`, `qwen35moe`): the layers'
kinds from `attention.recurrent_layers` (or every `full_attention_interval`-th attends), the
linear layers' sizes from `ssm.*`, the MTP block (`nextn_predict_layers` extra blocks) apart;
the converter's layouts undone: norms stored as 1 + w (but `ssm_norm`), A as -exp(A_log), the
conv kernel squeezed; qwen35 files keep their value heads "tiled" (the layer runs in that order).
"""

from dataclasses import dataclass, field, replace

import torch

from treadle.model.config import LIMITS, ModelConfig, ModelLoadError, MoEConfig, file_float, file_int
from treadle.model.families.bamba import BambaModel
from treadle.model.families.llama import DecoderLayer, LayerWeights, expected_shapes, weight_part
from treadle.model.families.qwen_moe import hf_moe
from treadle.model.layers.attention import paged_attention
from treadle.model.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from treadle.model.layers.linear import Linear
from treadle.model.layers.moe import MoE
from treadle.model.layers.norm import RMSNorm
from treadle.model.layers.recurrent import RecurrentState
from treadle.model.layers.rotary import apply_rotary
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

HF_LAYER_TYPES = {"linear_attention": "recurrent", "full_attention": "attention"}


@dataclass
class Qwen3NextConfig(ModelConfig):
    gdn: GatedDeltaNetConfig = field(default_factory=lambda: GatedDeltaNetConfig(1, 1, 1, 1))
    keep_mtp: bool = False  # the engine drafts with the MTP head: its weights are kept (`mtp_weights`)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state in every Gated DeltaNet layer."""
        return RecurrentState.nbytes(self.gdn, self.layer_types.count("recurrent"), torch.float32)  # conv state too


def interval_layer_types(layers: int, interval: int) -> list[str]:
    """Every `interval`-th layer attends (layers interval - 1, 2 interval - 1, ...), the rest are linear."""
    return ["attention" if (i + 1) % interval == 0 else "recurrent" for i in range(layers)]


class Qwen3NextLayer(DecoderLayer):
    def __init__(self, config: Qwen3NextConfig, lw: LayerWeights):
        self.input_norm = lw.norm("input_layernorm.weight")
        self.post_attention_norm = lw.norm("post_attention_layernorm.weight")
        self.mixer = self.qkv = self.o_proj = self.q_norm = self.k_norm = None
        if config.layer_types[lw.index] == "recurrent":
            if lw.prefix + "attn_qkv.weight" in lw.w:  # a GGUF file's name for the linear layer's q/k/v
                lw.w[lw.prefix + "linear_attn.in_proj_qkv.weight"] = lw.w.pop(lw.prefix + "attn_qkv.weight")
            self.mixer = GatedDeltaNet(config.gdn, lw, index=config.layer_types[: lw.index].count("recurrent"))
        else:
            fused = lw.prefix + "attn_qkv.weight" in lw.w  # a GGUF file's fused q/k/v (the converter's --fuse-qkv)
            names = ("attn_qkv.weight",) if fused else tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
            self.qkv = lw.linear(names)
            self.q_norm = lw.norm("self_attn.q_norm.weight")
            self.k_norm = lw.norm("self_attn.k_norm.weight")
            self.o_proj = lw.linear(("self_attn.o_proj.weight",))
        if config.moe is not None and config.moe.sparse(lw.index):
            self.moe = MoE(config, lw)
            self.gate_up = self.down = None
        else:
            self.gate_up = lw.linear(("mlp.gate_proj.weight", "mlp.up_proj.weight"))
            self.down = lw.linear(("mlp.down_proj.weight",))


class Qwen3NextModel(BambaModel):
    """A hybrid as Bamba's (its residual stream and state handling), with Gated DeltaNet layers."""

    hf_model_types = ("qwen3_next",)
    hf_architectures = ("Qwen3NextForCausalLM",)
    gguf_architectures = ("qwen3next",)

    layer_class = Qwen3NextLayer
    gguf_permuted_qk = False
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_qkv.weight": "attn_qkv.weight",  # a linear layer's q/k/v, or a full layer's fused: by the layer's kind
        "attn_gate.weight": "linear_attn.in_proj_z.weight",
        "ssm_beta.weight": "linear_attn.in_proj_b.weight",
        "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
        "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
        "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
        "ssm_conv1d.weight": "linear_attn.conv1d.weight",
        "ssm_dt.bias": "linear_attn.dt_bias",
        "ssm_a": "linear_attn.A",
        "ssm_norm.weight": "linear_attn.norm.weight",
        "ssm_out.weight": "linear_attn.out_proj.weight",
        "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
        **{
            f"nextn.{n}": f"nextn.{n}"
            for n in (
                "eh_proj.weight",
                "enorm.weight",
                "hnorm.weight",
                "shared_head_norm.weight",
                "shared_head_head.weight",
                "embed_tokens.weight",
            )
        },  # fmt: skip (the MTP block: dropped)
    }
    gguf_value_order = "grouped"  # qwen3next files keep Hugging Face's value-head order

    # ---------------------------------------------------------------- config.json

    @classmethod
    def text_config(cls, hf):
        """A multimodal folder's text model: `text_config` over the top level (whose tying wins)."""
        merged = {**hf.cfg, **hf.section("text_config")}
        if "tie_word_embeddings" in hf.cfg:
            merged["tie_word_embeddings"] = hf.cfg["tie_word_embeddings"]
        return type(hf)(hf.folder, merged, hf.arch)

    @classmethod
    def config_from_hf(cls, hf) -> Qwen3NextConfig:
        hf = cls.text_config(hf)
        layers = hf.int("num_hidden_layers", "num_layers")
        types = hf.get("layer_types")
        if types is None:
            interval = file_int(hf.where, "full_attention_interval", hf.get("full_attention_interval", 4), 1, layers)
            layer_types = interval_layer_types(layers, interval)
        elif isinstance(types, list) and len(types) == layers and all(t in HF_LAYER_TYPES for t in types):
            layer_types = [HF_LAYER_TYPES[t] for t in types]
        else:
            raise ModelLoadError(f"{hf.where}: layer_types = {types!r}: expected {layers} of {sorted(HF_LAYER_TYPES)}")
        if "attention" not in layer_types:
            raise ModelLoadError(f"{hf.where}: layer_types: no full_attention layer (not supported)")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
            raise ModelLoadError(f"{hf.where}: hidden_act / attention_bias: only silu and no bias are supported")
        nk = file_int(hf.where, "linear_num_key_heads", hf.need("linear_num_key_heads"), 1, 1 << 10)
        nv = file_int(hf.where, "linear_num_value_heads", hf.need("linear_num_value_heads"), 1, 1 << 10)
        if nv % nk:
            raise ModelLoadError(f"{hf.where}: linear_num_value_heads = {nv}: not a multiple of linear_num_key_heads")
        gdn = GatedDeltaNetConfig(
            num_k_heads=nk,
            num_v_heads=nv,
            head_k_dim=file_int(hf.where, "linear_key_head_dim", hf.need("linear_key_head_dim"), 1, 1024),
            head_v_dim=file_int(hf.where, "linear_value_head_dim", hf.need("linear_value_head_dim"), 1, 1024),
            d_conv=file_int(hf.where, "linear_conv_kernel_dim", hf.get("linear_conv_kernel_dim", 4), 2, 64),
            norm_eps=file_float(hf.where, "rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        )
        rope = hf.rope({"partial_rotary_factor": 0.25, **(hf.section("rope_parameters") or hf.section("rope_scaling"))})
        config = hf.llama_style(
            Qwen3NextConfig,
            rope=rope,
            qk_norm=True,
            layer_types=layer_types,
            gdn=gdn,
            moe=cls.hf_experts(hf),
        )
        return hf.checked(config)

    @classmethod
    def hf_experts(cls, hf) -> MoEConfig | None:
        if not hf.get("num_experts"):
            return None
        return hf_moe(hf, norm_topk=bool(hf.get("norm_topk_prob", True)), shared=True)

    # ---------------------------------------------------------------- GGUF

    @classmethod
    def config_from_gguf(cls, gguf) -> Qwen3NextConfig:
        blocks = gguf.number("block_count", *LIMITS["num_layers"], required=True)
        extra = gguf.number("nextn_predict_layers", 0, blocks - 1, default=0)  # the MTP block(s), after the model's
        layers = blocks - extra
        recurrent = gguf.get("attention.recurrent_layers")
        if recurrent is None:
            interval = gguf.number("full_attention_interval", 1, layers, default=4)
            layer_types = interval_layer_types(layers, interval)
        elif isinstance(recurrent, list) and len(recurrent) in (layers, blocks):
            layer_types = ["recurrent" if r else "attention" for r in recurrent[:layers]]
        else:
            raise gguf.fail("attention.recurrent_layers", f"expected one flag per layer ({blocks})")
        if "attention" not in layer_types:
            raise gguf.fail("attention.recurrent_layers", "no full-attention layer (not supported)")
        nk = gguf.number("ssm.group_count", 1, 1 << 10, required=True)
        nv = gguf.number("ssm.time_step_rank", 1, 1 << 10, required=True)
        head = gguf.number("ssm.state_size", 1, 1024, required=True)
        if nv % nk:
            raise gguf.fail("ssm.time_step_rank", f"{nv}: not a multiple of ssm.group_count = {nk}")
        if gguf.get("ssm.inner_size", nv * head) != nv * head:
            raise gguf.fail("ssm.inner_size", f"expected {nv * head} (time_step_rank x state_size)")
        eps = gguf.get("attention.layer_norm_rms_epsilon", 1e-6)
        gdn = GatedDeltaNetConfig(
            num_k_heads=nk,
            num_v_heads=nv,
            head_k_dim=head,
            head_v_dim=head,
            d_conv=gguf.number("ssm.conv_kernel", 2, 64, required=True),
            norm_eps=file_float(gguf.path, f"{gguf.arch}.attention.layer_norm_rms_epsilon", eps),
            v_order=cls.gguf_value_order,
        )
        moe = gguf.moe(norm_topk=True)  # llama.cpp renormalises the chosen experts of all three
        if moe is not None:  # a layer without a router keeps a dense MLP (a Qwen3-Next's mlp_only_layers)
            sparse = [f"blk.{i}.ffn_gate_inp.weight" in gguf.tensor_names for i in range(layers)]
            moe = replace(moe, sparse_layers=None if all(sparse) else sparse)
        dense = gguf.get("feed_forward_length")
        config = gguf.llama_style(
            Qwen3NextConfig,
            partial_rotary=True,
            num_layers=layers,
            intermediate_size=dense if dense else (moe.shared_size or moe.expert_size) if moe else None,
            qk_norm=True,
            layer_types=layer_types,
            gdn=gdn,
            moe=moe,
        )
        return gguf.checked(config)

    @staticmethod
    def from_gguf_tensor(name: str, data):
        # llama.cpp's converter stores the (1 + w) norms as 1 + w; the linear layers' own norm as w
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return data - data.dtype.type(1.0)
        return data

    # ---------------------------------------------------------------- the model

    @staticmethod
    def expected_shapes(config: Qwen3NextConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(config)
        g, h = config.gdn, config.hidden_size
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            if kind == "recurrent":
                for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                    shapes.pop(p + f"self_attn.{name}.weight", None)
                shapes.update({p + "linear_attn." + k: v for k, v in {
                    "in_proj_qkv.weight": (g.conv_dim, h), "in_proj_z.weight": (g.value_dim, h),
                    "in_proj_b.weight": (g.num_v_heads, h), "in_proj_a.weight": (g.num_v_heads, h),
                    "in_proj_qkvz.weight": (g.conv_dim + g.value_dim, h), "in_proj_ba.weight": (2 * g.num_v_heads, h),
                    "out_proj.weight": (h, g.value_dim), "norm.weight": (g.head_v_dim,),
                }.items()})  # fmt: skip
            else:
                shapes[p + "self_attn.q_proj.weight"] = (2 * config.num_heads * config.head_dim, h)
        return shapes

    def __init__(
        self, config: Qwen3NextConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        # the MTP head's weights, under the checkpoint's names (mtp.fc.weight, mtp.layers.0. ...), where
        # the engine drafts with it (`config.keep_mtp`); a multimodal folder's vision tower is not read
        self.mtp_weights = {}
        for name in list(weights):
            mtp = _mtp_name(config, name)
            if mtp is not None:
                if config.keep_mtp:
                    self.mtp_weights[mtp] = weights.pop(name)
                else:
                    del weights[name]
            elif name.startswith("model.visual."):
                del weights[name]
            elif name.startswith("model.language_model."):
                weights["model." + name.removeprefix("model.language_model.")] = weights.pop(name)
        super().__init__(config, weights, dtype, device, batch_invariant)

    def mtp_config(self) -> Qwen3NextConfig:
        """The MTP head's configuration: one full-attention layer of this model's shape, its feed-forward
        the model's (experts where the model's last layer has them)."""
        cfg = self.config
        layer = f"mtp.layers.0.mlp.{'gate.weight' if cfg.moe is not None else 'gate_proj.weight'}"
        if not self.mtp_weights or "mtp.fc.weight" not in self.mtp_weights or layer not in self.mtp_weights:
            raise ModelLoadError(
                f"{cfg.name}: speculative_config method mtp: the model file has no MTP head (mtp.* weights, "
                "or a GGUF file's nextn block)"
            )
        moe = replace(cfg.moe, sparse_layers=None) if cfg.moe is not None else None
        return replace(
            cfg, architecture=cfg.architecture + "_mtp", num_layers=1, layer_types=["attention"], layer_windows=None,
            moe=moe, keep_mtp=False,
        )  # fmt: skip

    def make_norm(self, weight) -> RMSNorm:
        """(1 + weight), formed in float32, then in the model's dtype (as transformers computes it)."""
        return RMSNorm((1.0 + weight.float()).to(device=self.device, dtype=self.dtype), self.config.rms_norm_eps)

    def new_state(self) -> RecurrentState:
        """A request's state in every Gated DeltaNet layer, zeroed (the runner makes one per request)."""
        return RecurrentState.zeros(self.config.gdn, self.recurrent_layers, torch.float32, self.device)

    def linears(self):
        out = [self.lm_head]
        for layer in self.layers:
            out += layer.mixer.linears() if layer.mixer is not None else [layer.qkv, layer.o_proj]
            out += layer.moe.linears() if layer.moe is not None else [layer.gate_up, layer.down]
        return out

    def attention(self, layer, x: torch.Tensor, tables, kv, layer_meta) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = x.shape[0]
        qg, k, v = layer.qkv(x).split_with_sizes([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(t, heads, 2 * hd)
        q, gate = layer.q_norm(qg[:, :, :hd]), qg[:, :, hd:]
        qk = apply_rotary(torch.cat([q, layer.k_norm(k.view(t, kv_heads, hd))], dim=1), *tables)
        q, k = qk.split_with_sizes([heads, kv_heads], dim=1)
        attn = paged_attention(q, k, v.view(t, kv_heads, hd), kv[0], kv[1], layer_meta, self.scale)
        return layer.o_proj(attn.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size)))


def _mtp_name(config: Qwen3NextConfig, name: str) -> str | None:
    """The checkpoint name (mtp.*) of an MTP head's weight: a folder's `mtp.` / `model.mtp.`, or a GGUF
    file's extra block (layers from num_layers on: `nextn.*` and a full-attention layer); else None."""
    if name.startswith(("mtp.", "model.mtp.")):
        return name.removeprefix("model.")
    if not name.startswith("model.layers."):
        return None
    _, _, index, rest = name.split(".", 3)
    if not index.isdigit() or int(index) < config.num_layers:
        return None
    if rest.startswith("nextn."):
        return GGUF_NEXTN.get(rest)  # None: the shared head or embedding a block may repeat (not read)
    return f"mtp.layers.{int(index) - config.num_layers}.{rest}"


# a GGUF nextn block's own tensors -> the checkpoint's
GGUF_NEXTN = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}


class Qwen3NextMtp(Qwen3NextModel):
    """The multi-token-prediction head as a model of its own (the engine's MTP draft, engine/mtp.py):
    row i takes the token at position i + 1 and the target's final hidden state at position i,
    fc([norm(embed(token)), norm(hidden)]) through one full-attention layer (its own KV, at position i)
    and a final norm into the target's head: a guess at the token at position i + 2. Built from the
    target's `mtp_weights` with the target's embedding and head (the same tensors). `hidden_in`: the
    step's hidden inputs, one row per input row in the runner's order (`ModelRunner.row_order`);
    `hidden_out`: the final (normed) hidden states of the rows whose logits the last forward gave."""

    hf_model_types = ()
    hf_architectures = ()
    gguf_architectures = ()

    def __init__(
        self, config: Qwen3NextConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        renamed = {}
        for name, w in weights.items():
            if name.startswith("mtp.layers.0."):
                renamed["model.layers.0." + name.removeprefix("mtp.layers.0.")] = w
            elif name.startswith("mtp.layers."):
                continue  # a second MTP layer (none released): the first is used for every proposal
            elif name == "mtp.norm.weight":
                renamed["model.norm.weight"] = w
            else:
                renamed[name] = w
        weights.clear()
        if "mtp.fc.weight" not in renamed:
            raise ModelLoadError("weight mtp.fc.weight: missing")
        self.fc = Linear(weight_part(renamed, "mtp.fc.weight", dtype, device))  # (before: linears() lists it)
        norms = [renamed.pop(f"mtp.pre_fc_norm_{n}.weight") for n in ("embedding", "hidden")]
        super().__init__(replace(config, keep_mtp=False), renamed, dtype, device, batch_invariant)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = (self.make_norm(n) for n in norms)
        self.hidden_in: torch.Tensor | None = None
        self.hidden_out: torch.Tensor | None = None

    @staticmethod
    def expected_shapes(config: Qwen3NextConfig) -> dict[str, tuple[int, ...]]:
        return Qwen3NextModel.expected_shapes(config)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.pre_fc_norm_embedding(super().embedding(input_ids))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(self.hidden_in.to(e.dtype))], dim=-1))

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        self.hidden_out = self.norm(self.residual_stream(input_ids, positions, kv_caches, meta)[logits_indices])
        return self.logits(self.hidden_out)

    def greedy_head(self) -> bool:
        return False

    def linears(self):
        return super().linears() + [self.fc]


class Qwen35Model(Qwen3NextModel):
    """Qwen3.5 (dense): a SwiGLU MLP on every layer."""

    hf_model_types = ("qwen3_5_text", "qwen3_5")
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    gguf_architectures = ("qwen35",)

    gguf_value_order = "tiled"  # the converter reorders qwen35 files' value heads

    @classmethod
    def hf_experts(cls, hf) -> MoEConfig | None:
        return None


class Qwen35MoeModel(Qwen3NextModel):
    """Qwen3.5-MoE and Qwen3.6: experts and a gated shared expert on every layer, always renormalised."""

    hf_model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    gguf_architectures = ("qwen35moe",)

    gguf_value_order = "tiled"

    @classmethod
    def text_config(cls, hf):
        hf = super().text_config(hf)
        if "intermediate_size" not in hf.cfg:  # no dense MLP: the size is the shared expert's
            hf.cfg["intermediate_size"] = hf.need("shared_expert_intermediate_size")
        return hf

    @classmethod
    def hf_experts(cls, hf) -> MoEConfig | None:
        moe = hf_moe(hf, norm_topk=True, shared=True)
        return replace(moe, sparse_layers=None)
