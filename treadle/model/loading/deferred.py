"""Weights as the loaders hand them to the model: read from the file only when the model takes
them, one at a time, so that a load never holds the whole file's tensors beside the model's own
forms (a GGUF file's float tensors, a Hugging Face folder's safetensors)."""

from collections.abc import Callable

import torch


class DeferredWeight:
    """A file's tensor, read (and widened to float32) only when the model converts it to its own form.

    The model takes its weights one at a time, so at most one float32 tensor exists at once
    (loading the default model's 135M parameters as float32 all together took 540 MB of peak RSS
    for weights the model then rounds to its dtype).

    `load()` gives the tensor in float32. Optional: `stored()`, the tensor in the file's own dtype,
    which `to(dtype=...)` converts directly (the same values as through float32, without the
    float32 copy: a bfloat16 checkpoint's weights arrive in a bfloat16 model as they are read), and
    `rows(begin, end)`, float32 rows of a matrix read alone (a quantizer's pieces)."""

    __slots__ = ("_load", "_stored", "_rows", "shape", "dtype")

    def __init__(
        self,
        load: Callable[[], torch.Tensor],
        shape: tuple[int, ...],
        stored: Callable[[], torch.Tensor] | None = None,
        rows: Callable[[int, int], torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ):
        self._load, self._stored, self._rows = load, stored, rows
        self.shape = torch.Size(shape)
        self.dtype = dtype  # the file's dtype, where known (integer tensors are not weights to widen)

    def dim(self) -> int:
        return len(self.shape)

    def float(self) -> torch.Tensor:
        return self._load()

    def to(self, *args, **kwargs) -> torch.Tensor:
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        source = self._stored if dtype is not None and self._stored is not None else self._load
        return source().to(*args, **kwargs)

    def rows(self, begin: int, end: int) -> torch.Tensor:
        """Rows begin:end in float32."""
        return self._rows(begin, end) if self._rows is not None else self._load()[begin:end]

    def __getitem__(self, index) -> torch.Tensor:
        return self._load()[index]
