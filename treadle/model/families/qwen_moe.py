"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 decoders whose feed-forward is a mixture of experts (moe.py).

- Qwen3-MoE: q/k norms per head, no bias; the router's weights renormalised over the chosen
  experts where `norm_topk_prob` (every released Qwen3-MoE; llama.cpp always renormalises
  `qwen3moe` files);
- Qwen2-MoE: bias on q, k and v, no renormalisation, and a shared expert on every token scaled by
  sigmoid(shared_expert_gate(x)).

Layers are sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step` (those keep a
dense MLP of `intermediate_size`); GGUF files (llama.cpp's `qwen2moe`, `qwen3moe`) are sparse in
every layer.
"""

from treadle.model.config import ModelConfig, ModelLoadError, MoEConfig
from treadle.model.families.llama import Qwen2Model, Qwen3Model


def hf_moe(hf, norm_topk: bool, shared: bool) -> MoEConfig:
    """A Qwen MoE config.json's experts (Qwen2-MoE's shared expert where `shared`)."""
    num_layers = hf.int("num_hidden_layers", "num_layers")
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1 or not isinstance(dense, list) or not isinstance(num_layers, int):
        raise ModelLoadError(
            f"{hf.where}: decoder_sparse_step = {step!r}, mlp_only_layers = {dense!r}: "
            "expected an integer >= 1 and a list of layers"
        )
    return MoEConfig(
        num_experts=hf.get("num_experts", hf.get("num_local_experts")),
        top_k=hf.need("num_experts_per_tok"),
        expert_size=hf.need("moe_intermediate_size"),
        norm_topk=norm_topk,
        shared_size=hf.need("shared_expert_intermediate_size") if shared else 0,
        sparse_layers=[i not in dense and (i + 1) % step == 0 for i in range(num_layers)],
    )


def _window(hf):
    return (hf.get("sliding_window") if hf.get("use_sliding_window", False) else None) or None


class Qwen3MoeModel(Qwen3Model):
    hf_model_types = ("qwen3_moe",)
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_architectures = ("qwen3moe",)

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        moe = hf_moe(hf, norm_topk=bool(hf.get("norm_topk_prob", False)), shared=False)
        return hf.checked(hf.llama_style(qk_norm=True, sliding_window=_window(hf), moe=moe))


class Qwen2MoeModel(Qwen2Model):
    hf_model_types = ("qwen2_moe",)
    hf_architectures = ("Qwen2MoeForCausalLM",)
    gguf_architectures = ("qwen2moe",)

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        moe = hf_moe(hf, norm_topk=bool(hf.get("norm_topk_prob", False)), shared=True)
        return hf.checked(
            hf.llama_style(attention_bias=bool(hf.get("qkv_bias", True)), sliding_window=_window(hf), moe=moe)
        )

    @classmethod
    def config_from_gguf(cls, gguf) -> ModelConfig:
        return gguf.checked(gguf.llama_style(moe=gguf.moe(norm_topk=False)))
