"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) and Qwen2-VL (`Qwen2VLForConditionalGeneration`):
a Qwen2 language model (bias on q, k and v) that sees, through its ViT (qwen2_vl_vision.py; the two
towers differ, the language models do not).

- multimodal RoPE: a token's rotary position is (time, row, column), an image's tokens laid out on
  their grid and the text after an image going on from its largest position + 1
  (layers/mrope.py); config.json's `mrope_section` splits the frequencies among the three. The
  runner gives the positions (`mrope`, `image_grid`); a request without images has its index,
  three times;
- an image is `<|vision_start|>`, one `<|image_pad|>` per merge window of its patches,
  `<|vision_end|>`: the pads' rows take the encoder's outputs; the text attends causally to them;
- config.json holds the text model's hyperparameters in `text_config` (transformers 5) or at the
  top level (Qwen's files), the tower's in `vision_config`; tied embeddings where either says so;
- weights: `model.layers.*` and `visual.*` (Qwen's files, transformers 5's save_pretrained) or
  `model.language_model.*` and `model.visual.*` (transformers 4.5x);
- llama.cpp's `qwen2vl` GGUF files (both generations' text model; `rope.dimension_sections` the
  split) see through the mmproj file beside them, whose projector says which tower it is.
"""

from dataclasses import dataclass, field

import torch

from treadle.model.config import ModelConfig, ModelLoadError
from treadle.model.families.llama import ROPE_TABLE_CAP, LlamaModel
from treadle.model.families.qwen2_vl_vision import QwenVLVision
from treadle.model.layers.mrope import MultimodalRotaryEmbedding


@dataclass
class Qwen2VLConfig(ModelConfig):
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    multimodal: dict = field(default_factory=dict)  # config.json: the vision tower's settings, the image token
    deepstack_layers: int | None = None  # a GGUF file's n_deepstack_layers (Qwen3-VL; its mmproj must agree)


class Qwen25VLModel(LlamaModel):
    hf_model_types = ("qwen2_5_vl",)
    hf_architectures = ("Qwen2_5_VLForConditionalGeneration",)
    gguf_architectures = ("qwen2vl",)  # llama.cpp's name for Qwen2-VL's and Qwen2.5-VL's text model

    mrope = True
    gguf_permuted_qk = False
    mmproj_projectors = ("qwen2vl_merger", "qwen2.5vl_merger")
    # what the Qwen-VL generations differ in (qwen3_vl.py sets its own)
    vision_class = QwenVLVision
    default_rope_theta = 1e6
    interleaved_mrope = False  # Qwen3-VL's: the frequencies dealt t h w t h w ...

    @classmethod
    def tied(cls, hf) -> bool:
        """Whether the head is the embedding: where either level of config.json says so."""
        return bool(hf.get("tie_word_embeddings")) or bool(hf.section("text_config").get("tie_word_embeddings"))

    @classmethod
    def text_fields(cls, text: dict, text_hf) -> dict:
        """The language model's own fields beside Llama's (Qwen2: bias on q, k and v)."""
        return {"attention_bias": True}

    @classmethod
    def config_from_hf(cls, hf) -> Qwen2VLConfig:
        text = {**hf.cfg, **hf.section("text_config"), "tie_word_embeddings": cls.tied(hf)}
        text_hf = type(hf)(hf.folder, text, hf.arch)
        params = text_hf.section("rope_parameters") or text_hf.section("rope_scaling")
        section = params.get("mrope_section")
        if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) for s in section)):
            raise ModelLoadError(f"{hf.where}: mrope_section = {section!r}: expected three integers")
        # Qwen's files name the rotation "mrope" (its split is mrope_section); the frequencies are the default ones
        rope = text_hf.rope({k: v for k, v in params.items() if v != "mrope"}, default_theta=cls.default_rope_theta)
        window = text.get("sliding_window") if text.get("use_sliding_window", False) else None
        config = text_hf.llama_style(
            Qwen2VLConfig,
            sliding_window=window or None,
            rope=rope,
            mrope_section=section,
            multimodal=hf.cfg,
            **cls.text_fields(text, text_hf),
        )
        config = text_hf.checked(config)
        if sum(section) != config.head_dim // 2:
            raise ModelLoadError(f"{hf.where}: mrope_section = {section}: expected {config.head_dim // 2} in all")
        return config

    @classmethod
    def config_from_gguf(cls, gguf) -> Qwen2VLConfig:
        """llama.cpp's file: Qwen2's (or Qwen3's, qwen3_vl.py) hyperparameters and the M-RoPE split
        (`rope.dimension_sections`, a fourth entry 0); no tower settings (those are the mmproj's)."""
        sections = gguf.get("rope.dimension_sections", required=True)
        if not (isinstance(sections, list) and len(sections) >= 3 and all(isinstance(s, int) for s in sections)):
            raise gguf.fail("rope.dimension_sections", f"{sections!r}: expected three or four integers")
        if any(sections[3:]):
            raise gguf.fail("rope.dimension_sections", f"{sections!r}: a fourth section is not supported")
        fields = {"mrope_section": list(sections[:3]), **cls.gguf_fields(gguf)}
        config = gguf.checked(gguf.llama_style(Qwen2VLConfig, **fields))
        if sum(config.mrope_section) != config.head_dim // 2:
            raise gguf.fail("rope.dimension_sections", f"{sections}: expected {config.head_dim // 2} in all")
        return config

    @classmethod
    def gguf_fields(cls, gguf) -> dict:
        """The language model's own fields a GGUF file gives beside Llama's (Qwen3-VL-MoE: experts)."""
        return {}

    def __init__(self, config: Qwen2VLConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant=False):
        vision = {}
        for name in list(weights):
            if self.vision_class.is_vision_tensor(name):
                vision[name] = weights.pop(name)
            elif name.startswith("model.language_model."):
                weights["model." + name.removeprefix("model.language_model.")] = weights.pop(name)
        if config.multimodal:  # a folder's tower (a GGUF file's comes from its mmproj, `vision_from_mmproj`)
            self.vision = self.vision_class.from_hf(config.multimodal, vision.pop, list(vision), dtype, device)
            self.check_vision(config, "config.json")
        super().__init__(config, weights, dtype, device, batch_invariant)

    def vision_from_mmproj(self, path: str):
        from treadle.model.loading.gguf_file import open_gguf

        vision = self.vision_class.from_gguf(open_gguf(path), self.dtype, self.device)
        self.vision = vision
        self.check_vision(self.config, f"mmproj GGUF {path}")
        return vision

    def check_vision(self, config: Qwen2VLConfig, where: str) -> None:
        """What the tower must agree on with the language model: its outputs' width (Qwen3-VL: and DeepStack)."""
        out = self.vision.config.out_hidden_size
        if out != config.hidden_size:
            raise ModelLoadError(
                f"{where}: the image encoder gives {out}-wide embeddings; the language model's hidden_size is "
                f"{config.hidden_size}"
            )

    def rotary_for(self, rope) -> MultimodalRotaryEmbedding:
        cfg = self.config
        positions = cfg.position_table or min(cfg.max_position, ROPE_TABLE_CAP)
        return MultimodalRotaryEmbedding(
            rope, cfg.head_dim, positions, cfg.mrope_section, interleaved=self.interleaved_mrope
        ).to(self.device)

    def encode_image(self, pixels: torch.Tensor, extra: dict) -> torch.Tensor:
        return self.vision.encode(pixels, extra)

    def image_grid(self, extra: dict) -> tuple[int, int]:
        return self.vision.grid(extra)


class Qwen2VLModel(Qwen25VLModel):
    hf_model_types = ("qwen2_vl",)
    hf_architectures = ("Qwen2VLForConditionalGeneration",)
