"""The model store (`treadle pull / list / show / rm / cp`) against a local fake of the Hugging Face
hub's file API (tests/support/fake_hub.py), never the real hub: quant tags and file names, HF_TOKEN sent,
a mid-download disconnect resumed with a Range request, a pull killed and resumed by the next one,
a corrupt file refused, the HF cache reused, folders, plain URLs verified as GGUF, local imports."""

import json
import os
import signal
import subprocess
import sys
import time

import gguf
import pytest

from tests.support.fake_hub import FakeHub
from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle.cli import main
from treadle.store import ModelStore, StoreError

REPO = "tiny-org/tiny-llama-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random Llama as an HF folder (with generation defaults and a model card) and as GGUF
    files in two types."""
    root = tmp_path_factory.mktemp("models")
    folder = str(root / "hf")
    model = save_hf_model(folder, "llama", seed=3)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}, f)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("---\nlicense: mit\ntags: [test]\n---\n# a tiny model\n")
    paths = {"folder": folder}
    for tag, qtype in (("F32", None), ("Q8_0", gguf.GGMLQuantizationType.Q8_0)):
        path = str(root / f"tiny-llama-{tag}.gguf")
        write_gguf(path, "llama", model, tiny_tokenizer(), quantize=qtype)
        paths[tag] = path
    return paths


@pytest.fixture
def hub(files, monkeypatch, tmp_path):
    with FakeHub() as h:
        repo = h.repos.setdefault(REPO, {})
        for tag in ("F32", "Q8_0"):
            with open(files[tag], "rb") as f:
                repo[os.path.basename(files[tag])] = f.read()
        repo["README.md"] = b"---\nlicense: apache-2.0\n---\n"
        h.add_folder("tiny-org/tiny-llama", files["folder"])
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("TREADLE_MODELS", str(tmp_path / "store"))
        yield h


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_pull_by_quant_tag_sends_the_token_and_lists_the_model(hub, files, capsys):
    assert main(["pull", f"hf://{REPO}:Q8_0", "-q"]) == 0
    store = ModelStore()
    m = store.get("tiny-llama-gguf:Q8_0")
    assert _bytes(m["model_path"]) == _bytes(files["Q8_0"])
    gets = hub.gets("tiny-llama-Q8_0.gguf")
    assert gets and all(r["auth"] == "Bearer hf_test_token" for r in gets)
    assert not hub.gets("tiny-llama-F32.gguf")  # only the file asked for
    capsys.readouterr()
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["NAME", "SIZE", "ARCH", "PARAMS", "QUANT"]
    row = next(line for line in out if line.startswith("tiny-llama-gguf:Q8_0"))
    assert " llama " in row and " Q8_0 " in row and " 512 " in row  # architecture, quantization, context
    assert main(["show", "tiny-llama-gguf:Q8_0", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["architecture"] == "llama" and shown["quantization"] == "Q8_0" and shown["context_length"] == 512
    assert "<|im_start|>" in shown["chat_template"]


def test_unknown_repository_and_tag_are_clear_errors(hub, capsys):
    assert main(["pull", "tiny-org/no-such-repo", "-q"]) == 1
    assert "no-such-repo" in capsys.readouterr().err
    with pytest.raises(StoreError, match=r"no GGUF file for 'Q2_K'.*F32, Q8_0"):
        ModelStore().pull(f"{REPO}:Q2_K", progress=False)
    with pytest.raises(StoreError, match="several GGUF files"):
        ModelStore().pull(REPO, progress=False)
    assert ModelStore().manifests() == []


def test_a_dropped_connection_resumes_with_a_range_request(hub, files):
    name = "tiny-llama-F32.gguf"
    size = len(hub.repos[REPO][name])
    hub.cut_after[f"{REPO}/{name}"] = size // 3
    m = ModelStore().pull(f"{REPO}:{name}", progress=False)
    assert _bytes(m["model_path"]) == _bytes(files["F32"])
    ranges = [r["range"] for r in hub.gets(name)]
    assert ranges[0] is None and len(ranges) == 2
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= size // 3  # from what arrived whole
    assert hub.served[f"{REPO}/{name}"] <= 1.1 * size


def test_a_killed_pull_leaves_nothing_listed_and_the_next_one_resumes(hub, files, tmp_path):
    name = "tiny-llama-F32.gguf"
    size = len(hub.repos[REPO][name])
    # 8 KiB per 10 ms: what the killed pull loses is what was in flight (a chunk or two), well inside the
    # 10% the bytes-served bound allows (with 64 KiB chunks one chunk in flight was 17% of this file)
    hub.chunk, hub.delay = 8192, 0.01
    env = {**os.environ}
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle", "pull", f"hf://{REPO}:F32", "-q"], env=env, stderr=subprocess.PIPE
    )
    partial = tmp_path / "store" / ".partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = sum(p.stat().st_size for p in partial.glob("*.part")) if partial.exists() else 0
        if held >= size // 4:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert 0 < held < size
    assert ModelStore().manifests() == []
    hub.chunk, hub.delay = 65536, 0.0
    m = ModelStore().pull(f"hf://{REPO}:F32", progress=False)
    assert _bytes(m["model_path"]) == _bytes(files["F32"])
    last = hub.gets(name)[-1]["range"]
    assert last is not None and int(last.removeprefix("bytes=").rstrip("-")) >= held
    assert hub.served[f"{REPO}/{name}"] <= 1.1 * size
    assert not list(partial.glob("*.part"))


def test_a_corrupt_download_is_refused_and_discarded(hub, tmp_path):
    hub.corrupt.add(f"{REPO}/tiny-llama-Q8_0.gguf")
    with pytest.raises(StoreError, match="sha256 .* does not match .* corrupt"):
        ModelStore().pull(f"{REPO}:Q8_0", progress=False)
    assert ModelStore().manifests() == []
    assert not list((tmp_path / "store" / ".partial").glob("*.part"))
    hub.corrupt.clear()
    assert ModelStore().pull(f"{REPO}:Q8_0", progress=False)["name"] == "tiny-llama-gguf:Q8_0"


def test_a_file_in_the_hf_cache_is_not_fetched_again(hub, files, tmp_path):
    from huggingface_hub import hf_hub_download

    hf_hub_download(REPO, "tiny-llama-Q8_0.gguf", cache_dir=str(tmp_path / "hf-home" / "hub"), endpoint=hub.url)
    before = len(hub.gets("tiny-llama-Q8_0.gguf"))
    m = ModelStore().pull(f"{REPO}:Q8_0", progress=False)
    assert len(hub.gets("tiny-llama-Q8_0.gguf")) == before
    assert _bytes(m["model_path"]) == _bytes(files["Q8_0"])


def test_a_folder_repository_with_its_generation_defaults_and_license(hub, files, capsys):
    m = ModelStore().pull("tiny-org/tiny-llama", progress=False)
    assert m["name"] == "tiny-llama:latest" and os.path.isfile(os.path.join(m["model_path"], "config.json"))
    info = ModelStore().info("tiny-llama")
    assert info.format == "safetensors" and info.architecture == "llama" and info.context_length == 512
    assert info.defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    assert info.license == "mit"
    assert main(["show", "tiny-llama", "--parameters"]) == 0
    assert "temperature 0.6" in capsys.readouterr().out.splitlines()
    # Ollama-style parameters of the store's own override the model's
    ModelStore().set_parameters("tiny-llama", {"temperature": 0.2, "num_predict": 64})
    assert ModelStore().info("tiny-llama").defaults == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    with pytest.raises(ValueError, match="mirostat"):
        ModelStore().set_parameters("tiny-llama", {"mirostat": 1})


def test_a_plain_url_is_verified_as_a_gguf_before_it_is_listed(hub, files):
    data = _bytes(files["Q8_0"])
    hub.plain["good.gguf"] = data
    hub.plain["truncated.gguf"] = data[: len(data) // 2]
    m = ModelStore().pull(f"{hub.url}/files/good.gguf", progress=False)
    assert m["name"] == "good:latest" and _bytes(m["model_path"]) == data
    with pytest.raises(StoreError, match="not a whole GGUF file.*truncated"):
        ModelStore().pull(f"{hub.url}/files/truncated.gguf", progress=False)
    assert [x["name"] for x in ModelStore().manifests()] == ["good:latest"]


def test_local_import_copy_and_remove(files, tmp_path, capsys):
    store = str(tmp_path / "s")
    assert main(["pull", files["Q8_0"], "--name", "mine", "--models-dir", store]) == 0
    assert main(["pull", files["folder"], "--models-dir", store]) == 0
    assert main(["cp", "mine", "mine:copy", "--models-dir", store]) == 0
    assert (
        main(
            ["cp", "mine", "mine:cold", "--param", "temperature=0.2", "--param", 'stop=["END"]', "--models-dir", store]
        )
        == 0
    )
    assert ModelStore(store).info("mine:cold").defaults == {"temperature": 0.2, "stop": ["END"]}
    assert main(["cp", "mine", "mine:bad", "--param", "mirostat=1", "--models-dir", store]) == 1
    assert "mirostat" in capsys.readouterr().err
    assert main(["rm", "mine:cold", "--models-dir", store]) == 0
    names = [m["name"] for m in ModelStore(store).manifests()]
    assert names == ["hf:latest", "mine:copy", "mine:latest"]
    assert main(["rm", "mine", "--models-dir", store]) == 0
    assert main(["show", "mine", "--models-dir", store]) == 1
    assert "not in the store" in capsys.readouterr().err
    assert [m["name"] for m in ModelStore(store).manifests()] == ["hf:latest", "mine:copy"]
    with pytest.raises(StoreError, match="not a model name"):
        ModelStore(store).copy("mine:copy", "../escape")
    with pytest.raises(StoreError, match="no config.json"):
        ModelStore(store).pull(str(tmp_path))


def test_a_gguf_repository_s_mmproj_comes_with_its_model_and_the_entry_sees(hub, files):
    """As llama.cpp's -hf: the repository's image encoder (the F16 one of two) lands beside the
    model, and the store says the entry takes images."""
    repo = hub.repos[REPO]
    repo["mmproj-tiny-llama-F16.gguf"] = b"an image encoder"
    repo["mmproj-tiny-llama-Q8_0.gguf"] = b"another"
    m = ModelStore().pull(f"{REPO}:Q8_0", progress=False)
    folder = os.path.dirname(m["model_path"])
    assert sorted(os.listdir(folder)) == sorted(["tiny-llama-Q8_0.gguf", "mmproj-tiny-llama-F16.gguf", "manifest.json"])
    assert not hub.gets("mmproj-tiny-llama-Q8_0.gguf")
    assert m["info"]["vision"] is True
    assert ModelStore().pull(f"{REPO}:F32", progress=False)["info"]["vision"] is True
    del repo["mmproj-tiny-llama-F16.gguf"], repo["mmproj-tiny-llama-Q8_0.gguf"]
    assert ModelStore().pull(f"{REPO}:F32", progress=False)["info"]["vision"] is False
