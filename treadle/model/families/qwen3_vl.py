"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): a Qwen3 language model (RMSNorm on each head of q
and k, no q/k/v bias) that sees, through its ViT (qwen3_vl_vision.py).

- multimodal RoPE as Qwen2.5-VL's (qwen2_vl.py: the same positions, `mrope`, `image_grid`) but
  **interleaved**: config.json's `mrope_section` (e.g. [24, 20, 20]) takes the frequencies in turn,
  t h w t h w ..., the time the rest (layers/mrope.py; transformers interleaves whatever
  `mrope_interleaved` says);
- **DeepStack**: the encoder gives each image token more embeddings, from earlier blocks of the
  tower (`deepstack_visual_indexes`); the k-th is added to the image rows' hidden states after
  decoder layer k (transformers' `Qwen3VLTextModel._deepstack_process`). The encoder's output
  carries them beside the main embeddings ([tokens, (1 + k) * hidden]); `place_images` places the
  first `hidden` columns, and a step with image rows runs its layers here, in Python (not the C
  path: the adds fall between layers);
- an image is `<|vision_start|>`, one `<|image_pad|>` per merge window, `<|vision_end|>`;
- config.json holds the text model's hyperparameters in `text_config`, the tower's in
  `vision_config`; rotary settings in `rope_parameters` (transformers 5) or `rope_scaling`
  (Qwen's files, theta beside it); tied embeddings where the top level says so (transformers 5's
  rule), else where `text_config` does;
- weights: `model.language_model.*` and `model.visual.*` (Qwen's files, transformers'
  save_pretrained), or `model.layers.*` and `visual.*`;
- llama.cpp's `qwen3vl` / `qwen3vlmoe` GGUF files (`n_deepstack_layers` their DeepStack count) see
  through the `qwen3vl_merger` mmproj file beside them.
"""

import torch

from treadle.model.config import ModelLoadError
from treadle.model.families.qwen2_vl import Qwen2VLConfig, Qwen25VLModel
from treadle.model.families.qwen3_vl_vision import Qwen3VLVision
from treadle.model.families.qwen_moe import hf_moe
from treadle.model.layers.attention import metadata_by_layer


class Qwen3VLModel(Qwen25VLModel):
    hf_model_types = ("qwen3_vl",)
    hf_architectures = ("Qwen3VLForConditionalGeneration",)
    gguf_architectures = ("qwen3vl",)

    mmproj_projectors = ("qwen3vl_merger",)

    vision_class = Qwen3VLVision
    default_rope_theta = 5e6
    interleaved_mrope = True

    @classmethod
    def tied(cls, hf) -> bool:
        """transformers 5 ties by the top level's flag where it is set (Qwen3-VL-MoE's text_config
        says True by default), else by text_config's."""
        tie = hf.get("tie_word_embeddings")
        return bool(tie if tie is not None else hf.section("text_config").get("tie_word_embeddings"))

    @classmethod
    def text_fields(cls, text: dict, text_hf) -> dict:
        return {"qk_norm": True, "attention_bias": bool(text.get("attention_bias", False))}

    @classmethod
    def gguf_fields(cls, gguf) -> dict:
        deepstack = gguf.number("n_deepstack_layers", 0, 1 << 10, default=0)
        return {"deepstack_layers": deepstack}

    def check_vision(self, config: Qwen2VLConfig, where: str) -> None:
        super().check_vision(config, where)
        if self.vision.deepstack > config.num_layers:
            raise ModelLoadError(
                f"{where}: {self.vision.deepstack} deepstack_visual_indexes: "
                f"expected at most num_hidden_layers ({config.num_layers})"
            )
        declared = config.deepstack_layers
        if declared is not None and declared != self.vision.deepstack:
            raise ModelLoadError(
                f"{where}: {self.vision.deepstack} DeepStack layers; the text model's file says n_deepstack_layers = "
                f"{declared}"
            )

    def place_images(self, h: torch.Tensor) -> torch.Tensor:
        """The image rows take the encoder's main embeddings (the first `hidden` columns)."""
        if self.image_rows is not None:
            rows, values = self.image_rows
            h.index_copy_(0, rows, values[:, : h.shape[1]].to(h.dtype))
        return h

    def residual_stream(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        if self.image_rows is None or not self.vision.deepstack:
            return super().residual_stream(input_ids, positions, kv_caches, meta)
        rows, values = self.image_rows
        deepstack = values.split(self.config.hidden_size, dim=1)[1:]
        h = self.place_images(self.embedding(input_ids))  # a fresh tensor: the residual adds below are in place
        tables = self.rotary.tables(positions)
        metas = metadata_by_layer(meta, self.layer_groups)
        for i, (layer, kv, layer_meta) in enumerate(zip(self.layers, kv_caches, metas)):
            h += self.attention(layer, layer.input_norm(h), tables, kv, layer_meta)
            h += self.feed_forward(layer, layer.post_attention_norm(h))
            if i < len(deepstack):
                h.index_add_(0, rows, deepstack[i].to(h.dtype))
        return h


class Qwen3VLMoeModel(Qwen3VLModel):
    """Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`): Qwen3-VL whose feed-forward is Qwen3-MoE's
    experts (qwen_moe.py; the router's weights always renormalised over the chosen, as transformers
    does), stacked per layer: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`. Qwen's files store
    them transposed ([experts, hidden, 2 * moe_intermediate_size], [experts, moe_intermediate_size,
    hidden]; transformers' conversion transposes them at load), transformers' save_pretrained as
    moe.py takes them; a tensor is transposed where its shape is not moe.py's (as transformers
    decides)."""

    hf_model_types = ("qwen3_vl_moe",)
    hf_architectures = ("Qwen3VLMoeForConditionalGeneration",)
    gguf_architectures = ("qwen3vlmoe",)

    @classmethod
    def gguf_fields(cls, gguf) -> dict:
        return {**super().gguf_fields(gguf), "moe": gguf.moe(norm_topk=True)}

    @classmethod
    def text_fields(cls, text: dict, text_hf) -> dict:
        return {**super().text_fields(text, text_hf), "moe": hf_moe(text_hf, norm_topk=True, shared=False)}

    def __init__(self, config: Qwen2VLConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant=False):
        n, h, f = config.moe.num_experts, config.hidden_size, config.moe.expert_size
        expected = {"mlp.experts.gate_up_proj": (n, 2 * f, h), "mlp.experts.down_proj": (n, h, f)}
        for name in list(weights):
            shape = next((s for suffix, s in expected.items() if name.endswith(suffix)), None)
            if shape is not None and tuple(weights[name].shape) == (shape[0], shape[2], shape[1]) != shape:
                weights[name] = transposed(weights[name])
        super().__init__(config, weights, dtype, device, batch_invariant)


def transposed(w):
    """A stacked [experts, a, b] weight as [experts, b, a], read when taken (as `w` would be): a
    loader's deferred weight (loading/deferred.py, not imported here) becomes another of its kind."""
    if isinstance(w, torch.Tensor):
        return w.transpose(1, 2).contiguous()
    stored = (lambda: w.to(dtype=w.dtype).transpose(1, 2).contiguous()) if w.dtype is not None else None
    shape = (w.shape[0], w.shape[2], w.shape[1])
    return type(w)(lambda: w.float().transpose(1, 2).contiguous(), shape, stored=stored, dtype=w.dtype)
