"""What every image encoder's reader of llama.cpp's mmproj files shares (the GGUF files
`convert_hf_to_gguf.py --mmproj` writes beside a model): the file's tensors as float32 in the
Hugging Face shape, by their names in the file, and the check of its projector type. The towers
(layers/siglip.py, families/*_vision.py) map those names to their own."""

from collections.abc import Callable

import torch

from treadle.model.config import ModelLoadError

WHERE = "mmproj GGUF"  # how load errors name the file
SCALE_KEY = "clip.vision.projector.scale_factor"  # patches per side pooled (Gemma 3) or shuffled (Idefics3) into one


def gguf_float32(tensor) -> torch.Tensor:
    """An mmproj tensor's values as float32 in the Hugging Face shape (GGUF lists dims fastest first)."""
    import numpy as np

    if tensor.tensor_type.name in ("F32", "F16"):
        data = np.asarray(tensor.data, dtype=np.float32)
    else:
        from gguf import quants  # gguf-py's dequantization, for block-quantized types

        data = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))


def tensor_reader(reader) -> Callable[[str], torch.Tensor]:
    """`read(name)`: the file's tensor of that name as float32; a missing one is a ModelLoadError.
    `read.names` holds the names the file has."""
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"{WHERE}: no tensor {name}")
        return gguf_float32(tensors[name])

    read.names = set(tensors)
    return read


def check_projector(meta: dict, kinds: tuple[str, ...], family: str) -> str:
    """The file's `clip.projector_type`, refused unless it is one of `kinds` (the `family`'s)."""
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if meta.get("general.architecture") != "clip" or kind not in kinds:
        raise ModelLoadError(f"{WHERE}: clip.projector_type = {kind!r}: not a {family} mmproj file")
    return kind
