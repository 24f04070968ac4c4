"""OLMoE: a Llama-style decoder with a mixture of experts in every layer (moe.py; the chosen
experts' weights renormalised only where `norm_topk_prob`), RMSNorm over the whole q and k
projections (all heads at once, not per head), and q, k, v optionally clamped (`clip_qkv`).
llama.cpp's `olmoe` files hold the same tensors (experts stacked).
"""

from treadle.model.config import ModelConfig, MoEConfig
from treadle.model.families.llama import LlamaModel


class OlmoeModel(LlamaModel):
    hf_model_types = ("olmoe",)
    hf_architectures = ("OlmoeForCausalLM",)
    gguf_architectures = ("olmoe",)

    gguf_permuted_qk = False

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        moe = MoEConfig(
            num_experts=hf.need("num_experts"),
            top_k=hf.need("num_experts_per_tok"),
            expert_size=hf.need("intermediate_size"),
            norm_topk=bool(hf.get("norm_topk_prob", False)),
        )
        return hf.checked(hf.llama_style(qk_norm=True, qk_norm_per_head=False, clip_qkv=hf.get("clip_qkv"), moe=moe))

    @classmethod
    def config_from_gguf(cls, gguf) -> ModelConfig:
        return gguf.checked(gguf.llama_style(qk_norm_per_head=False, moe=gguf.moe(norm_topk=False)))
