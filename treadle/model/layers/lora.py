"""LoRA adapters on a loaded model, as PEFT saves them (adapter_config.json + adapter_model.safetensors)
or as llama.cpp's convert_lora_to_gguf.py writes them (a GGUF file of general.type "adapter").

An adapter adds, to each matrix it targets, y += scale * (x A^T) B^T (A: [r, in], B: [out, r];
scale = lora_alpha / r, or / sqrt(r) with use_rslora), and nothing else: the base weights are
never touched or copied. Each target lands on the `Linear` that holds that checkpoint matrix
(`Linear.sources`); where one Linear holds several (q, k and v joined), the adapter's A matrices of
its targets there are stacked and its B matrices placed in their output rows, so one adapter is
one low-rank product pair per Linear. The runner tells the Linears which rows of a step use which
adapter (`layers.LORA_ROWS`): a step serves the base model and several adapters at once.

What PEFT can save and this does not take is refused by name: DoRA, bias training, modules_to_save,
embedding or lm_head targets, fan_in_fan_out, a rank above --max-lora-rank.
"""

import hashlib
import json
import math
import os
import re

from treadle.model.config import ModelLoadError

# torch is imported where tensors are made: the front end (no torch) reads adapter configs and digests here

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ModelLoadError):
    pass


def read_adapter_config(path: str) -> dict:
    """The adapter folder's adapter_config.json, checked for what treadle can apply ({} for a GGUF
    file: its header is read when the core loads it)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return {}
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraError(
            f"{path}: not a folder or a .gguf file "
            f"(a LoRA adapter is a PEFT folder: {CONFIG_FILE} and {WEIGHTS_FILE}; or a GGUF LoRA)"
        )
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"{path}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{file}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: expected a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{file}: peft_type {cfg.get('peft_type')!r}: only LORA adapters are supported")
    refused = {
        "use_dora": cfg.get("use_dora") not in (None, False),
        "bias": cfg.get("bias") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "fan_in_fan_out": cfg.get("fan_in_fan_out") not in (None, False),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    for key, bad in refused.items():
        if bad:
            raise LoraError(f"{file}: {key} = {cfg.get(key)!r} is not supported")
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"{file}: lora_alpha {alpha!r} is not a number")
    return cfg


def adapter_digest(path: str) -> str:
    """A short hash of the adapter's files: its identity in prefix-cache keys (no KV is shared
    between adapters, nor with an adapter that replaced another under the same name)."""
    h = hashlib.sha256()
    if os.path.isfile(path):  # a GGUF LoRA
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()[:16]
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")


def read_adapter(path: str, max_rank: int, model_config=None) -> tuple[dict, dict]:
    """(config, {module name: (A, B, scale)}) of a PEFT adapter folder or a GGUF LoRA file, A and
    B in float32 (`model_config`: the base's, for a GGUF file's head counts)."""
    if os.path.isfile(path):
        return {}, read_gguf_adapter(path, max_rank, model_config)
    import torch

    cfg = read_adapter_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoraError(f"{path}: no {WEIGHTS_FILE} (treadle reads safetensors only)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{file}: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(
                f"{file}: tensor {key}: not a LoRA A or B matrix (embedding and lm_head adapters are not supported)"
            )
        halves.setdefault(m.group(1), {})[m.group(2)] = t
    if not halves:
        raise LoraError(f"{file}: no LoRA matrices")
    out = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{file}: {module}: lora_{'A' if 'A' not in ab else 'B'} is missing")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoraError(
                f"{file}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a low-rank product"
            )
        r = a.shape[0]
        if r > max_rank:
            raise LoraError(f"{file}: {module}: rank {r} is above --max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{file}: {module}: non-finite values")
        alpha = float(cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[module] = (a, b, scale)
    return cfg, out


def read_gguf_adapter(path: str, max_rank: int, model_config) -> dict:
    """A GGUF LoRA (llama.cpp's convert_lora_to_gguf.py): tensors `blk.N.attn_q.weight.lora_a` /
    `.lora_b`, the scale adapter.lora.alpha / rank (1 where alpha is 0, as llama.cpp does); the B
    rows of attn_q / attn_k put back from llama.cpp's RoPE permutation, as the base's are."""
    import torch

    from treadle.model.families.registry import resolve_model_class
    from treadle.model.loading.gguf_file import open_gguf
    from treadle.model.loading.gguf_loader import _dequantize, _undo_qk_permutation
    from treadle.model.loading.gguf_names import hf_name

    try:
        reader = open_gguf(path)
    except (OSError, ValueError) as e:
        raise LoraError(f"{path}: {e}") from None
    meta = reader.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoraError(
            f"{path}: not a GGUF LoRA adapter "
            f"(general.type {meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})"
        )
    arch = meta.get("general.architecture")
    if model_config is not None and arch != model_config.architecture:
        raise LoraError(f"{path}: an adapter for architecture {arch!r}, the model is {model_config.architecture!r}")
    try:
        family = resolve_model_class(arch)
    except (KeyError, ValueError):
        raise LoraError(f"{path}: general.architecture {arch!r}: unsupported architecture") from None
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"{path}: adapter.lora.alpha {alpha!r} is not a number")
    halves: dict[str, dict] = {}
    for tensor in reader.tensors:
        base, dot, half = tensor.name.rpartition(".")
        if not dot or half not in ("lora_a", "lora_b"):
            raise LoraError(f"{path}: tensor {tensor.name}: not a LoRA A or B matrix")
        try:
            module = hf_name(path, base, family.gguf_layer_tensors).removesuffix(".weight")
        except ModelLoadError as e:
            raise LoraError(str(e)) from None
        w = torch.from_numpy(_dequantize(path, tensor).astype("float32"))
        if (
            half == "lora_b"
            and family.gguf_permuted_qk
            and model_config is not None
            and base.endswith(("attn_q.weight", "attn_k.weight"))
        ):
            heads = model_config.num_heads if base.endswith("attn_q.weight") else model_config.num_kv_heads
            w = torch.from_numpy(_undo_qk_permutation(w.numpy(), heads).copy())
        halves.setdefault(module, {})[half] = w
    out = {}
    for module, ab in halves.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoraError(f"{path}: {module}: {'lora_a' if 'lora_a' not in ab else 'lora_b'} is missing")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoraError(
                f"{path}: {module}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not make a low-rank product"
            )
        r = a.shape[0]
        if r > max_rank:
            raise LoraError(f"{path}: {module}: rank {r} is above --max-lora-rank {max_rank}")
        out[module] = (a, b, alpha / r if alpha else 1.0)
    if not out:
        raise LoraError(f"{path}: no LoRA matrices")
    return out


class LoraSet:
    """The adapters loaded on one model, each under an id the runner's requests refer to."""

    def __init__(self, linears: list, dtype, device, max_rank: int, model_config=None):
        self.dtype, self.device, self.max_rank, self.model_config = dtype, device, max_rank, model_config
        self.targets: dict[str, tuple] = {}  # module name -> (its Linear, first output row, rows)
        for linear in linears:
            row = 0
            for name, rows in linear.sources:
                self.targets[name] = (linear, row, rows)
                row += rows
        self.adapters: dict[int, list] = {}  # id -> the Linears it touches
        self.nbytes: dict[int, int] = {}

    def add(self, adapter_id: int, path: str) -> None:
        """Read and attach an adapter; a LoraError naming the file and the matrix if it does not fit."""
        import torch

        if adapter_id in self.adapters:
            raise LoraError(f"adapter id {adapter_id} is in use")
        _, modules = read_adapter(path, self.max_rank, self.model_config)
        per_linear: dict[int, list] = {}
        for module, (a, b, scale) in sorted(modules.items()):
            if module not in self.targets:
                raise LoraError(
                    f"{path}: {module}: this model has no such matrix (or treadle runs it in a form LoRA cannot target)"
                )
            linear, row, rows = self.targets[module]
            in_features = linear.parts[0].shape[1]
            if a.shape[1] != in_features or b.shape[0] != rows:
                raise LoraError(
                    f"{path}: {module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} "
                    f"do not fit its [{rows}, {in_features}] matrix"
                )
            per_linear.setdefault(id(linear), [linear, []])[1].append((row, rows, a, b * scale))
        touched, nbytes = [], 0
        for linear, pieces in per_linear.values():
            rank = sum(a.shape[0] for _, _, a, _ in pieces)
            out_rows = sum(r for _, r in linear.sources)
            a_all = torch.cat([a for _, _, a, _ in pieces]).to(self.device, self.dtype)
            b_all = torch.zeros(out_rows, rank)
            col = 0
            for row, rows, a, b in pieces:
                b_all[row : row + rows, col : col + a.shape[0]] = b
                col += a.shape[0]
            b_all = b_all.to(self.device, self.dtype)
            if linear.lora is None:
                linear.lora = {}
            linear.lora[adapter_id] = (a_all, b_all)
            touched.append(linear)
            nbytes += a_all.nbytes + b_all.nbytes
        self.adapters[adapter_id] = touched
        self.nbytes[adapter_id] = nbytes

    def remove(self, adapter_id: int) -> None:
        for linear in self.adapters.pop(adapter_id, []):
            linear.lora.pop(adapter_id, None)
        self.nbytes.pop(adapter_id, None)
