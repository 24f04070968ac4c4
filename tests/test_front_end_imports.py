"""The HTTP front end carries what it uses: its start-up path (the command line, the app, the
model's tokenizer and description) loads neither torch nor numpy, gguf-py or httpx (tens of MB of
resident memory each in a process that serves no tensor and downloads nothing)."""

import json
import subprocess
import sys

import pytest

from treadle.model.loading.default_model import default_model_path

HEAVY = ("torch", "numpy", "gguf", "httpx")

SCRIPT = """
import json, sys
from treadle.cli import build_parser
args = build_parser("serve").parse_args(["serve", "--model", sys.argv[1]])
import treadle.server.app, treadle.server.http_server
from treadle.model.loading.loader import load_tokenizer
from treadle.store.inspect import describe
tok = load_tokenizer(sys.argv[1])
info = describe(sys.argv[1])
assert tok.encode("Hello there") and info.quantization, info
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2:])))
"""


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tests.support.make_quant_files import tiny_model

    model, tok = tiny_model()
    folder = tmp_path_factory.mktemp("hf_front_end")
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_the_front_ends_start_loads_no_tensor_library(source, request):
    model = default_model_path() if source == "gguf" else request.getfixturevalue("hf_folder")
    out = subprocess.run([sys.executable, "-c", SCRIPT, model, *HEAVY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_bench_commands_are_still_there():
    """Built only for `treadle bench` (their modules load numpy and httpx)."""
    out = subprocess.run(
        [sys.executable, "-m", "treadle", "bench", "sweep", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--concurrency" in out.stdout


CORE_SCRIPT = """
import json, sys
from treadle.engine.core import EngineCore
from treadle.model.loading.gguf_loader import load_gguf
files = load_gguf(sys.argv[1])
assert files.tokenizer.eos_token_id is not None and files.weights
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2:])))
"""


def test_the_engine_cores_load_leaves_what_the_front_end_does():
    """The engine core's start (its modules, a GGUF file's load) imports neither the chat
    templates' jinja2 (~90 ms of its start, which is the server's: the front end renders), the
    gguf package (its `constants` alone) nor `tokenizers` (~4 MiB: its vocabulary is built for a
    structured-output request only), while the front end has jinja2 loaded before its first chat
    request."""
    out = subprocess.run(
        [sys.executable, "-c", CORE_SCRIPT, default_model_path(), "jinja2", "gguf", "tokenizers"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, default_model_path(), "jinja2"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jinja2" in json.loads(out.stdout.strip().splitlines()[-1])
