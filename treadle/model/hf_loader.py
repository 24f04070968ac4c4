"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer files."""

import glob
import os

from .config import LIMITS, ModelConfig, ModelFiles, ModelLoadError, RopeConfig, check_config, file_int
from .registry import HF_CLASS_NAMES, is_registered, registered_architectures
from .tokenizer import read_json, tokenizer_from_hf_folder


def read_config(folder: str) -> dict:
    """config.json as a dict (no torch: the tokenizer alone needs it too)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: config.json: missing, not a Hugging Face model folder")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _architecture(folder: str, cfg: dict) -> str:
    """model_type if registered, else the first registered `architectures` class name (a built-in
    family's class name as its model_type)."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and is_registered(model_type):
        return model_type
    classes = cfg.get("architectures") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ModelLoadError(f"{folder}/config.json: architectures = {classes!r}: expected a list of class names")
    for name in classes:
        if is_registered(name):
            return HF_CLASS_NAMES.get(name, name)
    listed = f", architectures = {classes!r}" if classes else ""
    raise ModelLoadError(
        f"{folder}/config.json: model_type = {model_type!r}{listed}: unsupported architecture "
        f"(supported: {', '.join(sorted(registered_architectures()))})"
    )


# ModelConfig's fields as config.json names them (for error messages)
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position": "max_position_embeddings", "sliding_window": "sliding_window",
    "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_factor": "rope_scaling.factor",
}  # fmt: skip


def _config_from_json(folder: str, cfg: dict) -> ModelConfig:
    """The Llama-style reader, for every registered architecture: the built-in families' quirks are
    keyed on their model_type. Every value is checked (check_config) before anything is built."""
    where = f"{folder}/config.json"
    arch = _architecture(folder, cfg)

    def need(key):
        if key not in cfg:
            raise ModelLoadError(f"{where}: {key}: missing")
        return cfg[key]

    def section(key) -> dict:
        value = cfg.get(key) or {}
        if not isinstance(value, dict):
            raise ModelLoadError(f"{where}: {key} = {value!r}: expected an object")
        return value

    hidden = file_int(where, "hidden_size", need("hidden_size"), *LIMITS["hidden_size"])
    heads = file_int(where, "num_attention_heads", need("num_attention_heads"), *LIMITS["num_heads"])
    rope_params = section("rope_parameters")
    scaling = section("rope_scaling") or rope_params
    rope = RopeConfig(theta=rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("llama3", "linear"):
        rope.scaling_type = kind
        rope.factor = scaling.get("factor", 1.0)
        rope.low_freq_factor = scaling.get("low_freq_factor", 1.0)
        rope.high_freq_factor = scaling.get("high_freq_factor", 4.0)
        rope.original_max_position = scaling.get("original_max_position_embeddings", 8192)
    elif kind not in (None, "default"):
        raise ModelLoadError(f"{where}: rope_scaling type {kind!r}: unsupported (supported: linear, llama3)")
    sliding = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None
    config = ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=rope,
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=sliding or None,
        name=os.path.basename(os.path.normpath(folder)),
    )
    return check_config(where, config, HF_KEYS)


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
