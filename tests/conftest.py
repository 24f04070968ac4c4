import os

import pytest
import torch

from treadle.model.loading.default_model import default_model_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def no_request_reaches_the_500_handler():
    """A request that reaches a server's 500 handler is a bug whatever the test checks: fail the
    test during which it happened (any `treadle serve` the session started, shared ones included)."""
    from tests.support.server_process import LIVE

    for server in list(LIVE):
        server.internal_errors()  # what came before this test is not this test's
    yield
    found = [line for server in list(LIVE) for line in server.internal_errors()]
    assert not found, "requests reached the server's 500 handler:\n" + "\n".join(found[:5])


KEY = "test-key"
SECOND_KEY = "second-test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def server():
    """One real `treadle serve` (float32; two API keys, /metrics behind them, request bodies
    logged) for the server and bench tests."""
    from tests.support.server_process import ServerProcess

    s = ServerProcess(
        "--api-key", KEY, "--api-key", SECOND_KEY, "--metrics-require-key", "--log-requests", "--max-num-seqs", "32"
    )
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def llm():
    """The default model in float32: the configuration the reference tests compare."""
    from treadle import LLM

    return LLM(dtype="float32", seed=0)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def version_of(model) -> tuple | None:
    """What identifies a model's files as they are now: config.json's bytes for a folder, size and
    mtime for a file."""
    import hashlib

    if model and os.path.isdir(model):
        with open(os.path.join(model, "config.json"), "rb") as f:
            return (hashlib.sha256(f.read()).hexdigest(),)
    if model and os.path.exists(model):
        st = os.stat(model)
        return (st.st_size, st.st_mtime_ns)
    return None


@pytest.fixture(scope="session")
def make_llm():
    """Build engines with other settings without re-reading the model file each time."""
    import dataclasses
    import functools

    from treadle import LLM
    from treadle.model.execution import worker as model_worker
    from treadle.model.kernels.quant import QuantizedTensor
    from treadle.model.layers.moe import ExpertWeights

    def load_once(model, version):
        # the loader defers converting float tensors to the model; for many engines, convert once
        # here (quantized tensors stay the file's blocks, as the model uses them; integer tensors,
        # such as an HF folder's MXFP4 blocks, their bytes)
        files = original(model)

        def once(v):
            if isinstance(v, (QuantizedTensor, ExpertWeights)):
                return v
            dtype = getattr(v, "dtype", None)
            return v.to(dtype=dtype) if dtype is not None and not dtype.is_floating_point else v.float()

        return dataclasses.replace(files, weights={k: once(v) for k, v in files.weights.items()})

    original = model_worker.load_model_files
    cached = functools.lru_cache(maxsize=4)(load_once)
    # engines consume the weight dicts they are given: hand each one its own dict (same tensors)
    # (keyed by the files' contents too: the patch lasts the session, and a test may rewrite a folder's config.json)
    model_worker.load_model_files = lambda model: dataclasses.replace(
        files := cached(model, version_of(model)), weights=dict(files.weights)
    )

    def build(**kwargs):
        kwargs.setdefault("dtype", "float32")
        return LLM(**kwargs)

    yield build
    model_worker.load_model_files = original
