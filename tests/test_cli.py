"""`treadle serve` builds its model's tokenizer before the front end's imports (cli._prebuild_tokenizer,
loader.prebuild_tokenizer): which argument lists name one model unambiguously, and the hand-over."""

import os
import shutil

import pytest

from treadle import cli
from treadle.model.loading import loader
from treadle.model.loading.default_model import default_model_path


@pytest.fixture
def prebuilt(monkeypatch):
    seen = []
    monkeypatch.setattr(loader, "prebuild_tokenizer", seen.append)
    return seen


def test_the_served_model_is_found_as_the_parser_finds_it(tmp_path, prebuilt):
    model = str(tmp_path / "m.gguf")
    shutil.copy(default_model_path(), model)
    for argv in (
        ["serve", model],
        ["serve", "--model", model, "--port", "8001"],
        ["serve", f"--model={model}"],
        ["serve", "-m", model],
    ):
        prebuilt.clear()
        cli._prebuild_tokenizer(argv)
        assert prebuilt == [model], argv
    for argv in (
        ["serve"],  # the default model: small, built where it is used
        ["serve", "--model", f"a={model}"],  # a named model of several
        ["serve", "--model", model, "--model", f"b={model}"],
        ["serve", model, "--models-dir", str(tmp_path)],
        ["serve", "--model", str(tmp_path / "missing.gguf")],
    ):
        prebuilt.clear()
        cli._prebuild_tokenizer(argv)
        assert prebuilt == [], argv


def test_a_prebuilt_tokenizer_is_handed_over_once_and_only_for_the_same_file(tmp_path):
    model = str(tmp_path / "m.gguf")
    shutil.copy(default_model_path(), model)
    loader.prebuild_tokenizer(model)
    first = loader.load_tokenizer(model)
    second = loader.load_tokenizer(model)
    assert first is not second  # handed over once; later loads build their own
    assert first.encode("Hello world") == second.encode("Hello world")
    loader.prebuild_tokenizer(model)
    (stale,) = loader._prebuilt.values()
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed since: not the prebuilt one
    try:
        assert loader.load_tokenizer(model) is not stale
    finally:
        loader._prebuilt.clear()


def test_a_file_that_cannot_be_read_leaves_the_error_to_the_load(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    loader.prebuild_tokenizer(str(bad))  # no error here
    with pytest.raises(ValueError, match="not a GGUF file"):
        loader.load_tokenizer(str(bad))
