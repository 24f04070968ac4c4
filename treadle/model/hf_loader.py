"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer files."""

import glob
import os

from .config import ModelConfig, ModelFiles, ModelLoadError, RopeConfig
from .registry import HF_CLASS_NAMES, is_registered, registered_architectures
from .tokenizer import read_json, tokenizer_from_hf_folder


def read_config(folder: str) -> dict:
    """config.json as a dict (no torch: the tokenizer alone needs it too)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: config.json: missing, not a Hugging Face model folder")
    return read_json(path)


def _architecture(folder: str, cfg: dict) -> str:
    """model_type if registered, else the first registered `architectures` class name (a built-in
    family's class name as its model_type)."""
    model_type = cfg.get("model_type")
    if is_registered(model_type):
        return model_type
    classes = cfg.get("architectures") or []
    for name in classes:
        if is_registered(name):
            return HF_CLASS_NAMES.get(name, name)
    listed = f", architectures = {classes!r}" if classes else ""
    raise ModelLoadError(
        f"{folder}/config.json: model_type = {model_type!r}{listed}: unsupported architecture "
        f"(supported: {', '.join(sorted(registered_architectures()))})"
    )


def _config_from_json(folder: str, cfg: dict) -> ModelConfig:
    """The Llama-style reader, for every registered architecture: the built-in families' quirks are
    keyed on their model_type."""
    arch = _architecture(folder, cfg)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope_params or {}
        rope = RopeConfig(theta=float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))))
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("llama3", "linear"):
            rope.scaling_type = kind
            rope.factor = float(scaling.get("factor", 1.0))
            rope.low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
            rope.high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
            rope.original_max_position = int(scaling.get("original_max_position_embeddings", 8192))
        elif kind not in (None, "default"):
            raise ModelLoadError(f"{folder}/config.json: rope_scaling type {kind!r}: unsupported (supported: linear, llama3)")
        sliding = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            name=os.path.basename(os.path.normpath(folder)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json: {e.args[0]}: missing") from e


def load_hf_folder(folder: str) -> ModelFiles:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw = read_config(folder)
    config = _config_from_json(folder, raw)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder}: *.safetensors: no weight files (treadle reads safetensors only)")
    weights = {}  # name -> float32 torch.Tensor
    for path in files:
        try:
            for name, tensor in load_file(path).items():
                weights[name] = tensor.float()
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file: {e}") from e
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        config.tie_word_embeddings = True
    tokenizer = tokenizer_from_hf_folder(folder, raw)
    return ModelFiles(config, weights, tokenizer)
