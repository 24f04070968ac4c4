"""Mutated GGUF files and HF folders (tests/support/fuzz_model_files.py) load or fail with ModelLoadError,
in a worker with bounded memory and time: never another exception, a crash, a hang or an
oversized allocation. A few hundred examples per format here, the same ones every run
(derandomized); the long run with random seeds is `python -m tests.support.fuzz_model_files`."""

import pytest

from tests.support.fuzz_model_files import Loader, run

EXAMPLES = 300  # per format


@pytest.fixture(scope="module")
def loader():
    worker = Loader()
    yield worker
    worker.close()


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_mutated_model_files_load_or_fail_with_a_model_load_error(fmt, loader, tmp_path):
    result = run(fmt, EXAMPLES, None, loader, str(tmp_path), derandomize=True)
    counts = result["counts"]
    assert not result["failures"], "\n".join(
        f"{outcome}: {'; '.join(steps)}\n{detail}" for steps, outcome, detail in result["failures"][:5]
    )
    assert sum(counts.values()) == EXAMPLES
    assert counts.get("ok", 0) > 0 and counts.get("load_error", 0) > EXAMPLES // 2  # both ends reached


def test_the_harness_sees_a_hang_and_replaces_the_worker(loader, tmp_path):
    """The harness can fail: a worker that stops answering (stopped by a signal here) is a hang
    once the time limit passes, and the next example gets a fresh worker."""
    import os
    import signal

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert loader.load(str(path))[0] == "load_error"
    os.kill(loader._proc.pid, signal.SIGSTOP)
    assert loader.load(str(path), timeout=1) == ("hang", "no answer within 1 s")
    assert loader.load(str(path))[0] == "load_error"
