"""The model registry, and a model family that a plugin adds without touching treadle.

The plugin (tests/support/plugin_gelu_llama.py) registers "gelu_llama": Llama with a GELU-tanh MLP. A random
model of it, saved as an HF folder, must decode token for token as transformers does, and differently
from the same weights run as Llama.
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

from tests.support import paths
from tests.support.reference import assert_matches_reference, hf_greedy
from tests.support.tiny_models import save_hf_model
from treadle.model.config import ModelLoadError
from treadle.model.families import registry
from treadle.model.families.llama import LlamaModel
from treadle.model.families.registry import (
    is_registered,
    load_plugins,
    register_model,
    registered_architectures,
    resolve_model_class,
    restore_registry,
)
from treadle.model.loading.gguf_loader import _config_from_metadata
from treadle.model.loading.hf_loader import _config_from_json
from treadle.model.loading.loader import load_model_files

PLUGIN = "tests.support.plugin_gelu_llama"
REPO = paths.REPO
# What a `treadle serve` process needs to load the plugin (the repo root makes `tests` importable).
PLUGIN_ENV = {
    "TREADLE_PLUGINS": PLUGIN,
    "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
}
NUM_TOKENS = 24


def write_gelu_llama_folder(folder: str, seed: int = 0):
    """A random "gelu_llama" HF folder: transformers' LlamaForCausalLM with hidden_act
    gelu_pytorch_tanh, whose config.json names the plugin's architecture in model_type and
    architectures (so without the plugin treadle refuses it instead of running it as Llama).
    Returns the transformers model, the reference."""
    model = save_hf_model(folder, "llama", seed, hidden_act="gelu_pytorch_tanh")
    _edit_config(folder, model_type="gelu_llama", architectures=["GeluLlamaForCausalLM"])
    return model


def gelu_llama_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 260, (n,), generator=g).tolist() for n in (21, 7, 40)]


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture
def fresh_registry(monkeypatch):
    """The built-in registry, no plugin loaded; each test's registrations end with it."""
    monkeypatch.setattr(registry, "_plugins", {})
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    monkeypatch.delenv("TREADLE_PLUGINS", raising=False)
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)  # so that loading it registers again
    return monkeypatch


@pytest.fixture
def with_plugin(fresh_registry):
    """The plugin loaded the way `treadle serve` loads it: named in TREADLE_PLUGINS."""
    fresh_registry.setenv("TREADLE_PLUGINS", PLUGIN)


@pytest.fixture(scope="module")
def gelu_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gelu_llama"))
    return folder, write_gelu_llama_folder(folder)


# ---------------------------------------------------------------- the registry


def test_builtin_architectures_and_their_hf_class_names_are_the_llama_decoder(fresh_registry):
    for arch in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ):
        assert is_registered(arch)
        assert issubclass(resolve_model_class(arch), LlamaModel)
    assert resolve_model_class("Qwen3ForCausalLM") is resolve_model_class("qwen3") is not resolve_model_class("llama")
    assert not is_registered("gelu_llama")


@pytest.mark.parametrize("target", registry.FAMILIES)
def test_the_registry_reads_each_family_s_names_as_its_class_declares_them(target):
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    declared = {field: cls.__dict__.get(field, ()) for field in registry.NAME_FIELDS}
    assert registry.declared_names(target) == declared
    assert declared["hf_model_types"], f"{target} declares no model_type"
    for arch in (name for names in declared.values() for name in names):
        assert resolve_model_class(arch) is cls


def test_a_family_s_names_are_its_own_not_its_parent_s(fresh_registry, tmp_path):
    (tmp_path / "kin_family.py").write_text(
        "from treadle.model.families.llama import LlamaModel\n\n\n"
        "class Parent(LlamaModel):\n    hf_model_types = ('parent',)\n    gguf_architectures = ('parentfile',)\n\n\n"
        'class Child(Parent):\n    """A child."""\n\n    hf_model_types = (\'child\',)  # its own\n'
    )
    fresh_registry.syspath_prepend(str(tmp_path))
    assert registry.declared_names("kin_family:Child") == {
        "hf_model_types": ("child",),
        "hf_architectures": (),
        "gguf_architectures": (),
    }
    assert registry.declared_names("kin_family:Parent")["gguf_architectures"] == ("parentfile",)


def test_two_families_declaring_one_name_are_refused(fresh_registry, tmp_path):
    (tmp_path / "twin_family.py").write_text(
        "from treadle.model.families.llama import LlamaModel\n\n\n"
        "class Twin(LlamaModel):\n    hf_model_types = ('llama',)\n"
    )
    fresh_registry.syspath_prepend(str(tmp_path))
    fresh_registry.setattr(registry, "FAMILIES", (*registry.FAMILIES, "twin_family:Twin"))
    fresh_registry.setattr(registry, "_builtin", None)
    with pytest.raises(
        ModelLoadError,
        match=r"architecture 'llama': declared by treadle.model.families.llama:LlamaModel and twin_family:Twin",
    ):
        resolve_model_class("llama")


def test_string_target_is_imported_on_first_lookup_only(fresh_registry, tmp_path):
    (tmp_path / "lazy_family.py").write_text(
        "from treadle.model.families.interface import CausalLM\n\n\nclass Model(CausalLM):\n    pass\n"
    )
    fresh_registry.syspath_prepend(str(tmp_path))
    fresh_registry.delitem(sys.modules, "lazy_family", raising=False)
    register_model("lazy", "lazy_family:Model")
    assert is_registered("lazy") and "lazy_family" not in sys.modules
    cls = resolve_model_class("lazy")
    assert cls.__module__ == "lazy_family" and cls.__name__ == "Model"


class Outer:
    class Nested(LlamaModel):
        pass


def test_class_target_is_kept_as_its_import_string(fresh_registry):
    register_model("nested", Outer.Nested)
    assert registered_architectures()["nested"] == "tests.model.families.test_registry:Outer.Nested"
    assert resolve_model_class("nested") is Outer.Nested


def test_unknown_architecture_names_itself_and_lists_the_registered_ones(fresh_registry):
    with pytest.raises(ModelLoadError, match=r"architecture 'rwkv7': not registered \(registered: .*llama.*qwen3"):
        resolve_model_class("rwkv7")


def test_a_class_that_does_not_implement_the_model_interface_is_refused(fresh_registry, tmp_path):
    (tmp_path / "odd_family.py").write_text("class Model:\n    def forward(self, *args):\n        pass\n")
    fresh_registry.syspath_prepend(str(tmp_path))
    fresh_registry.delitem(sys.modules, "odd_family", raising=False)
    register_model("odd", "odd_family:Model")
    with pytest.raises(
        ModelLoadError,
        match=r"architecture 'odd': odd_family:Model is not a subclass of treadle.model.families.interface.CausalLM",
    ):
        resolve_model_class("odd")


@pytest.mark.parametrize("target", ["no_such_module_xyz:Model", "treadle.model.families.llama:NoSuchModel"])
def test_bad_import_string_is_named(fresh_registry, target):
    register_model("broken", target)
    with pytest.raises(ModelLoadError, match=f"architecture 'broken': cannot import {target}"):
        resolve_model_class("broken")


def test_snapshot_is_plain_data_that_a_child_process_restores(fresh_registry):
    register_model("gelu_llama", f"{PLUGIN}:GeluLlamaModel")
    snapshot = registered_architectures()
    assert json.loads(json.dumps(snapshot)) == snapshot
    child = (
        "import json, sys\n"
        "from treadle.model.families.registry import restore_registry, resolve_model_class\n"
        "restore_registry(json.loads(sys.argv[1]))\n"
        "cls = resolve_model_class('gelu_llama')\n"
        "print(cls.__module__, cls.__qualname__)\n"
    )
    env = {**os.environ, **PLUGIN_ENV}
    env.pop("TREADLE_PLUGINS")  # the snapshot alone must be enough
    out = subprocess.run(
        [sys.executable, "-c", child, json.dumps(snapshot)], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [PLUGIN, "GeluLlamaModel"]


def test_restore_registry_applies_a_snapshot(fresh_registry):
    restore_registry({"gelu_llama": f"{PLUGIN}:GeluLlamaModel"})
    assert resolve_model_class("gelu_llama").__qualname__ == "GeluLlamaModel"


# ---------------------------------------------------------------- plugins


def test_plugin_named_in_the_environment_is_loaded_once(with_plugin):
    assert is_registered("gelu_llama")
    assert resolve_model_class("gelu_llama").__qualname__ == "GeluLlamaModel"
    del sys.modules[PLUGIN]
    load_plugins()
    assert PLUGIN not in sys.modules  # idempotent: not imported again


def test_entry_point_plugin_is_imported_and_called(fresh_registry):
    fresh_registry.setattr(
        registry,
        "entry_points",
        lambda group: [
            EntryPoint("gelu", PLUGIN, group),
            EntryPoint("more", "tests.model.families.test_registry:register_more", group),
        ],
    )
    assert is_registered("gelu_llama") and is_registered("more_llama")


def register_more():
    register_model("more_llama", LlamaModel)


def test_failing_plugin_is_named(fresh_registry):
    fresh_registry.setenv("TREADLE_PLUGINS", "tests.no_such_plugin_xyz")
    with pytest.raises(
        ModelLoadError, match=r"plugin 'tests.no_such_plugin_xyz' \(from TREADLE_PLUGINS\): cannot import"
    ):
        is_registered("llama")
    fresh_registry.setattr(
        registry,
        "entry_points",
        lambda group: [EntryPoint("bad", "tests.model.families.test_registry:failing_plugin", group)],
    )
    fresh_registry.delenv("TREADLE_PLUGINS")
    with pytest.raises(
        ModelLoadError,
        match=(
            r"plugin 'bad' \(tests.model.families.test_registry:failing_plugin, "
            r"entry point group treadle.plugins\): failed: boom"
        ),
    ):
        is_registered("llama")


def failing_plugin():
    raise RuntimeError("boom")


# ---------------------------------------------------------------- the loaders consult it

MINIMAL_HF = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_hf_folder_is_accepted_by_model_type_or_a_registered_class_name(fresh_registry):
    assert _config_from_json("m", {**MINIMAL_HF, "model_type": "qwen3"}).architecture == "qwen3"
    # an unregistered model_type with a built-in family's class name: that family, its quirks included
    cfg = _config_from_json("m", {**MINIMAL_HF, "model_type": "qwen2_custom", "architectures": ["Qwen2ForCausalLM"]})
    assert cfg.architecture == "qwen2" and cfg.attention_bias
    register_model("GeluLlamaForCausalLM", f"{PLUGIN}:GeluLlamaModel")
    cfg = _config_from_json("m", {**MINIMAL_HF, "model_type": "other", "architectures": ["GeluLlamaForCausalLM"]})
    assert cfg.architecture == "GeluLlamaForCausalLM"
    with pytest.raises(
        ModelLoadError,
        match=(
            r"m/config.json: model_type = 'rwkv7', architectures = \['Rwkv7ForCausalLM'\]: "
            r"unsupported architecture \(supported: "
        ),
    ):
        _config_from_json("m", {**MINIMAL_HF, "model_type": "rwkv7", "architectures": ["Rwkv7ForCausalLM"]})


def test_gguf_reads_a_registered_architecture_from_its_own_keys(fresh_registry):
    meta = {"gelu_llama.embedding_length": 64, "gelu_llama.attention.head_count": 4,
            "gelu_llama.feed_forward_length": 96, "gelu_llama.block_count": 2,
            "gelu_llama.vocab_size": 300}  # fmt: skip
    with pytest.raises(
        ModelLoadError,
        match=(
            r"general.architecture = 'gelu_llama': unsupported architecture \(supported: "
            r"gemma2, gemma3, gemma4, gpt-oss, granitehybrid, llama, olmoe, phi3, qwen2, qwen2moe, qwen2vl, qwen3, "
            r"qwen35, qwen35moe, qwen3moe, qwen3next, qwen3vl, qwen3vlmoe\)"
        ),
    ):
        _config_from_metadata("m.gguf", {**meta, "general.architecture": "gelu_llama"}, set())
    register_model("gelu_llama", f"{PLUGIN}:GeluLlamaModel")
    cfg = _config_from_metadata("m.gguf", {**meta, "general.architecture": "gelu_llama"}, set())
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers) == ("gelu_llama", 64, 2)
    with pytest.raises(
        ModelLoadError, match="'mistral': unsupported architecture"
    ):  # llama.cpp writes Mistral as llama
        _config_from_metadata("m.gguf", {"general.architecture": "mistral"}, set())


# ---------------------------------------------------------------- a plugin's model, end to end


def test_plugin_folder_is_refused_without_the_plugin(fresh_registry, gelu_folder):
    folder, _ = gelu_folder
    with pytest.raises(ModelLoadError, match=r"model_type = 'gelu_llama', .*: unsupported architecture"):
        load_model_files(folder)


def test_plugin_model_matches_transformers_and_is_not_llama(with_plugin, gelu_folder, tmp_path):
    from treadle import LLM, SamplingParams

    folder, model = gelu_folder
    assert model.config.hidden_act == "gelu_pytorch_tanh"
    assert load_model_files(folder).config.architecture == "gelu_llama"
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    llm = LLM(folder, dtype="float32", max_model_len=256, block_size=8)

    def cont(prefix, n):
        return (
            llm.generate([prefix], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
            if n
            else []
        )

    ps = gelu_llama_prompts()
    ours = [out.outputs[0].token_ids for out in llm.generate(ps, params)]
    for ids, tokens in zip(ps, ours):
        ref, rows = hf_greedy(model, ids, NUM_TOKENS)
        assert_matches_reference(ids, tokens, ref, rows, cont)

    # The same weights under model_type "llama" (SiLU) decode differently: the plugin is no alias.
    plain = str(tmp_path / "as_llama")
    shutil.copytree(folder, plain)
    _edit_config(plain, model_type="llama", architectures=["LlamaForCausalLM"])
    as_llama = [
        out.outputs[0].token_ids
        for out in LLM(plain, dtype="float32", max_model_len=256, block_size=8).generate(ps, params)
    ]
    assert all(a != b for a, b in zip(ours, as_llama))


def test_a_class_another_process_cannot_import_is_refused_at_registration(fresh_registry):
    class Local(LlamaModel):
        pass

    with pytest.raises(ValueError, match="importable by name"):
        register_model("local_arch", Local)
    assert not is_registered("local_arch")
