"""What the runner may call on a model: the interface every model family implements.

A family is one module with a subclass of `CausalLM` and one line in `registry.py` (or a plugin's
`register_model`). The runner builds it as `cls(config, weights, dtype, device, batch_invariant=...)`
(the constructor consumes `weights`: each float32 tensor is freed once its stored form exists) and
then calls only what is declared here; the compiler process (`compiled.py`) traces `forward`.

`llama.py` is the reference implementation.
"""

import torch

from .attention import AttentionMetadata
from .config import ModelConfig
from .kernels.quant import QuantizedTensor
from .layers import Linear

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key blocks, value blocks)


class CausalLM:
    config: ModelConfig
    dtype: torch.dtype
    # whether `hidden_states` is implemented: embedding requests are refused otherwise
    provides_hidden_states: bool = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """Run the step's T tokens (a flattened batch: attention alone sees request boundaries,
        through `meta`), writing their keys and values into `kv_caches` at `meta.slot_mapping`;
        return float32 logits of the rows in `logits_indices`."""
        raise NotImplementedError

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata) -> torch.Tensor:
        """The final (normed) hidden state of every one of the step's T rows: what embeddings pool."""
        raise NotImplementedError(f"{type(self).__name__} does not provide hidden states")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states."""
        raise NotImplementedError

    def linears(self) -> list[Linear]:
        """Every matrix product's `Linear`: where the runner and the compiler find quantized layers."""
        return []

    def tensors(self) -> list[torch.Tensor | QuantizedTensor]:
        """Every stored tensor other than the linears' (embeddings, norms, rotary tables)."""
        return []

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of every stored weight form by its type ("bfloat16", "Q4_K", ...), a tensor shared
        by two uses counted once."""
        seen, out = set(), {}
        forms = [form for linear in self.linears() for form in linear.stored_forms()]  # first: they name quantized types
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
