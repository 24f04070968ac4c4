"""What the runner may call on a model: the interface every model family implements.

A family is one module with a subclass of `CausalLM` that declares the names files call it by, and
one line in `registry.py`'s FAMILIES (or a plugin's `register_model`). The loaders ask the registered
class to read its own hyperparameters (`config_from_hf`, `config_from_gguf`; the defaults read a
Llama-style file) and how llama.cpp names and lays out its tensors (`gguf_layer_tensors`,
`gguf_permuted_qk`, `from_gguf_tensor`). The runner builds it as
`cls(config, weights, dtype, device, batch_invariant=...)` (the constructor consumes `weights`: each is
read from its file when taken, `deferred.DeferredWeight`, and its float32 copy freed once its stored
form exists) and then calls only what is declared here; the compiler process (`compiled.py`) traces
`forward`.

`llama.py` is the reference implementation.
"""

import numpy as np
import torch

from treadle.model.config import ModelConfig
from treadle.model.kernels.quant import QuantizedTensor
from treadle.model.layers.attention import AttentionMetadata
from treadle.model.layers.linear import Linear
from treadle.model.layers.rotary import RotaryEmbedding
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key blocks, value blocks)


class CausalLM:
    config: ModelConfig
    dtype: torch.dtype
    # whether `hidden_states` is implemented: embedding requests are refused otherwise
    provides_hidden_states: bool = False
    # a model that sees: its image encoder (a family's *_vision.py), whose outputs `encode_image`
    # gives; None for a text model (the engine refuses images then)
    vision = None
    # whether an image's tokens attend to each other both ways (Gemma 3), not causally
    bidirectional_images: bool = False
    # the `clip.projector_type`s of llama.cpp's mmproj files the family reads (config.mmproj)
    mmproj_projectors: tuple[str, ...] = ()
    # set by the runner around a forward whose prompt chunks hold images: (rows [R], values [R, hidden]),
    # the encoder's outputs that replace those rows' embeddings (`place_images`)
    image_rows: tuple | None = None
    # multimodal RoPE (Qwen-VL, layers/mrope.py): a token's rotary position is (time, row, column),
    # from its request's images (`image_grid`); `forward` then takes [T] positions (text, each
    # index shifted) or [3, T] (a step whose rows hold image tokens)
    mrope: bool = False

    # ---------------------------------------------------------------- the names files call it by
    # Literals in the class body, each class its own (not inherited): registry.py reads them from
    # the source without importing the family.
    hf_model_types: tuple[str, ...] = ()  # config.json `model_type`s (the first: its canonical name)
    hf_architectures: tuple[str, ...] = ()  # config.json `architectures` class names
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture`s

    # ---------------------------------------------------------------- reading the family's files
    # llama.cpp's names of a layer's tensors (after "blk.N.") -> the Hugging Face names the model takes
    gguf_layer_tensors: dict[str, str] = LLAMA_LAYER_TENSORS
    # whether llama.cpp's converter permuted the Q and K rows of this architecture (undone at load)
    gguf_permuted_qk: bool = False

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        """config.json (an `hf_loader.HFConfig`) -> the checked ModelConfig."""
        return hf.checked(hf.llama_style())

    @classmethod
    def config_from_gguf(cls, gguf) -> ModelConfig:
        """A GGUF file's metadata (a `gguf_loader.GGUFConfig`) -> the checked ModelConfig."""
        return gguf.checked(gguf.llama_style())

    @staticmethod
    def from_gguf_tensor(name: str, data: np.ndarray) -> np.ndarray:
        """A float tensor of a GGUF file in the Hugging Face convention (`name`: its HF name)."""
        return data

    @staticmethod
    def rope_freqs_head_dim(config) -> int:
        """The head size a GGUF file's rope_freqs tensor (one factor per frequency pair) rotates."""
        return config.head_dim

    @staticmethod
    def rope_factors(factors: list[float]) -> list[float]:
        """A GGUF file's rope_freqs factors as RopeConfig.freq_factors (divisors of the frequencies)."""
        return factors

    @staticmethod
    def gguf_tensor_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A float tensor's shape in the Hugging Face layout, from its shape in the file (the
        values are reshaped to it: same order, another shape)."""
        return shape

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata | list[AttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step's T tokens (a flattened batch: attention alone sees request boundaries,
        through `meta`), writing their keys and values into `kv_caches` (per layer) at
        `meta.slot_mapping`; return float32 logits of the rows in `logits_indices`. A model whose
        layers form several cache groups (`config.windows()`, kv_layout.py) gets a list, one
        metadata per group (`attention.metadata_by_layer`)."""
        raise NotImplementedError

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final (normed) hidden state of every one of the step's T rows: what embeddings pool."""
        raise NotImplementedError(f"{type(self).__name__} does not provide hidden states")

    def encode_image(self, pixels: torch.Tensor, extra: dict) -> torch.Tensor:
        """One preprocessed image (float32, its processor's shape; `extra`: what else its processor
        gave) -> the embeddings of its placeholder tokens [tokens, hidden], in the model's dtype (a
        family may return more columns that its own `place_images` reads: Qwen3-VL's DeepStack)."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    def image_grid(self, extra: dict) -> tuple[int, int]:
        """An M-RoPE model's image: (rows, columns) of its tokens' grid, from what its processor gave."""
        raise NotImplementedError(f"{type(self).__name__} has no multimodal RoPE")

    @property
    def image_token_id(self) -> int:
        """The token whose rows take an image's embeddings."""
        return self.vision.image_token_id

    def place_images(self, h: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings `h` with the image rows' replaced by the encoder's (in place)."""
        if self.image_rows is not None:
            rows, values = self.image_rows
            h.index_copy_(0, rows, values.to(h.dtype))
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states."""
        raise NotImplementedError

    def greedy_forward(self, input_ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        """`forward(...).max(dim=-1).indices` (the first maximal index of each row) without the
        whole [rows, vocab] logits at once; called only where `greedy_head` says so."""
        raise NotImplementedError

    def greedy_head(self) -> bool:
        """Whether `greedy_forward` answers this step (the runner asks before running it)."""
        return False

    def linears(self) -> list[Linear]:
        """Every matrix product's `Linear`: where the runner and the compiler find quantized layers."""
        return []

    def tensors(self) -> list[torch.Tensor | QuantizedTensor]:
        """Every stored tensor other than the linears' (embeddings, norms; not the rotary tables,
        which are derived, and resident as far as they are filled)."""
        return []

    def cover_positions(self, n: int) -> None:
        """Fill the model's rotary tables through position n - 1 (`RotaryEmbedding.cover`): the
        runner's call before a compiled step, whose graph reads the tables as they are."""
        for value in vars(self).values():
            if isinstance(value, RotaryEmbedding):
                value.cover(n)

    def other_forms(self) -> list[tuple[torch.Tensor, str]]:
        """Stored tensors neither a linear nor in `tensors`, with the type their bytes are counted
        under (a mixture of experts' expert weights)."""
        return []

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of every stored weight form by its type ("bfloat16", "Q4_K", ...), a tensor shared
        by two uses counted once."""
        seen, out = set(), {}
        forms = [
            form for linear in self.linears() for form in linear.stored_forms()
        ]  # first: they name quantized types
        forms += self.other_forms()
        for t in self.tensors():
            if isinstance(t, QuantizedTensor):
                forms.append((t.data, t.kind))
            elif t is not None:
                forms.append((t, str(t.dtype).removeprefix("torch.")))
        for t, kind in forms:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
        return out

    def has_quantized_linears(self) -> bool:
        return any(linear.quantized for linear in self.linears())
