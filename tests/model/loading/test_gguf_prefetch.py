"""model/gguf_prefetch.py: a GGUF file's quantized tensors repacked ahead of the load (while the
engine core imports torch) give the load exactly the tensors it would have made, and only for the
file it loads."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support import paths
from treadle import cli
from treadle.model.kernels import quant
from treadle.model.kernels.quant import QuantizedTensor
from treadle.model.loading import gguf_loader, gguf_prefetch

DATA = os.path.join(paths.DATA, "quant")
ISAS = [i for i in ("vnni", "avx2", "portable") if quant.available() and i in quant.supported_isas()]


def counted_loads(monkeypatch) -> list[str]:
    """The tensors the load repacks itself (gguf_loader._quantized_weight)."""
    names = []
    plain = gguf_loader._quantized_weight

    def counting(path, reader, tensor, heads, out=None):
        names.append(tensor.name)
        return plain(path, reader, tensor, heads, out)

    monkeypatch.setattr(gguf_loader, "_quantized_weight", counting)
    return names


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("isa", ISAS)
def test_prefetched_load_holds_the_same_tensors(kind, isa, monkeypatch):
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    path = os.path.join(DATA, f"{kind}.gguf")
    plain = gguf_loader.load_gguf(path)
    repacked_by_load = counted_loads(monkeypatch)
    gguf_prefetch.prefetch(path)
    fetched = gguf_loader.load_gguf(path)
    assert gguf_prefetch._job is None  # taken
    quantized = {k for k, v in plain.weights.items() if isinstance(v, QuantizedTensor)}
    assert quantized and quantized == {k for k, v in fetched.weights.items() if isinstance(v, QuantizedTensor)}
    for name in quantized:
        a, b = plain.weights[name], fetched.weights[name]
        assert (a.kind, a.shape, a.packed) == (b.kind, b.shape, b.packed)
        assert torch.equal(a.data, b.data), name
    if isa == "portable":  # the file's blocks as they are: nothing to repack ahead
        assert len(repacked_by_load) == len(quantized)
    else:  # only what the load may reorder (Q and K), and what is joined with them (V), is left to it
        assert repacked_by_load and all(
            n.endswith((*gguf_prefetch.LEFT_TO_LOAD, "attn_v.weight")) for n in repacked_by_load
        )
        assert len(repacked_by_load) < len(quantized)


def joined_buffers(weights: dict) -> list[list[str]]:
    """The groups of quantized weights that lie one after another in one buffer."""
    groups: dict[int, list] = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedTensor) and w.data._base is not None:
            groups.setdefault(w.data._base.data_ptr(), []).append((w.data.data_ptr(), name, w))
    out = []
    for parts in groups.values():
        parts.sort(key=lambda p: p[0])
        for (at, _, w), (nxt, _, _) in zip(parts, parts[1:]):
            assert at + w.data.numel() == nxt  # adjacent, nothing between
        out.append([name for _, name, _ in parts])
    return sorted(out)


def test_the_join_plan_takes_runs_of_alike_tensors():
    """Runs of two or more consecutive parts of one type and row size, whole 16-row groups in all
    but a run's last: a Q4_K_M layer with V in Q6_K joins Q and K; a part of 8 rows ends its run."""
    from types import SimpleNamespace

    import numpy as np

    def tensor(name, kind, rows, row_bytes=144):
        return SimpleNamespace(
            name=name, tensor_type=SimpleNamespace(name=kind), data=np.empty((rows, row_bytes), np.uint8)
        )

    tensors = [
        tensor("blk.0.attn_q.weight", "Q4_K", 64),
        tensor("blk.0.attn_k.weight", "Q4_K", 32),
        tensor("blk.0.attn_v.weight", "Q6_K", 32, 210),
        tensor("blk.0.ffn_gate.weight", "Q4_K", 8),  # not whole 16-row groups: alone
        tensor("blk.0.ffn_up.weight", "Q4_K", 8),
        tensor("blk.1.attn_q.weight", "Q8_0", 64, 34),
        tensor("blk.1.attn_k.weight", "Q8_0", 30, 34),  # a run's last may have any rows
        tensor("blk.1.attn_v.weight", "Q8_0", 32, 34),  # ... but then ends it
        tensor("blk.1.ffn_gate.weight", "F16", 64, 512),  # not a quantized type
        tensor("blk.1.ffn_up.weight", "F16", 64, 512),
        tensor("blk.2.attn_q.weight", "Q4_K", 64),  # no K, V: no group
    ]
    plan = gguf_prefetch.join_plan(tensors, quant.TYPES)
    joints = {}
    for name, joint in plan.items():
        joints.setdefault(joint.key, []).append((joint.first_row[name], name))
    assert {key: sorted(parts) for key, parts in joints.items()} == {
        "blk.0.attn_q.weight": [(0, "blk.0.attn_q.weight"), (64, "blk.0.attn_k.weight")],
        "blk.1.attn_q.weight": [(0, "blk.1.attn_q.weight"), (64, "blk.1.attn_k.weight")],
    }
    assert plan["blk.0.attn_q.weight"].rows == 96 and plan["blk.1.attn_k.weight"].rows == 94


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_load_reads_each_layers_joined_tensors_into_one_buffer(prefetch):
    """q/k/v and gate/up, read into one buffer each in the model's order, so that the model's join
    of them (QuantizedTensor.cat) is a view, not a copy; the model built on them computes as one
    built from separate parts (the same bytes)."""
    from treadle.model.layers.linear import Linear

    path = os.path.join(DATA, "Q4_K.gguf")
    if prefetch:
        gguf_prefetch.prefetch(path)
    files = gguf_loader.load_gguf(path)
    layers = sorted({n.split(".")[2] for n in files.weights if n.startswith("model.layers.")}, key=int)
    qkv = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers for p in "qkv"]
    gate_up = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in layers for p in ("gate", "up")]
    expected = sorted(
        [qkv[i : i + 3] for i in range(0, len(qkv), 3)] + [gate_up[i : i + 2] for i in range(0, len(gate_up), 2)]
    )
    assert joined_buffers(files.weights) == expected
    parts = [files.weights[n] for n in expected[0]]
    copies = [
        QuantizedTensor.from_packed(p.kind, p.data.clone(), p.shape[1])
        if p.packed
        else QuantizedTensor(p.kind, p.data.clone(), p.shape[1])
        for p in parts
    ]
    joined, copied = Linear(parts).parts, Linear(copies).parts
    assert len(joined) == len(copied) == 1
    assert joined[0].data.data_ptr() == parts[0].data.data_ptr()  # a view of the buffer
    assert copied[0].data.data_ptr() not in {p.data.data_ptr() for p in copies}  # separate parts: a copy
    assert torch.equal(joined[0].data, copied[0].data)
    x = torch.randn(3, parts[0].shape[1])
    assert torch.equal(joined[0].matmul(x), copied[0].matmul(x))
    # parts of one buffer that are not whole rows one after another are copied, not viewed
    base = parts[0].data._base
    every_other = []
    for i in (0, 16):  # "adjacent" by their first bytes, but every other row
        part = QuantizedTensor.__new__(QuantizedTensor)  # (from_packed takes no strided rows)
        part.kind, part.packed, part.data = parts[0].kind, parts[0].packed, base[i : i + 32 : 2]
        part.shape = torch.Size((16, parts[0].shape[1]))
        every_other.append(part)
    strided = QuantizedTensor.cat(every_other)
    assert strided.data.data_ptr() not in {p.data.data_ptr() for p in every_other}
    assert torch.equal(strided.data, torch.cat([p.data for p in every_other]))


def test_a_prefetch_of_a_file_in_another_order_holds_the_same_tensors(monkeypatch):
    """A file may store a layer's tensors in any order (up before gate, as converters of some
    models write them): the prefetch hands a joined buffer over once all its parts are packed,
    not when the last in the model's order is."""
    from treadle.model.loading import gguf_file

    if "vnni" not in ISAS and "avx2" not in ISAS:
        pytest.skip("no packed path on this CPU: nothing is prefetched")
    path = os.path.join(DATA, "Q4_K.gguf")
    plain = gguf_loader.load_gguf(path)
    opened = gguf_file.open_gguf

    def reversed_order(*args, **kwargs):
        f = opened(*args, **kwargs)
        f.tensors = f.tensors[::-1]  # ffn_up before ffn_gate, attn_v before attn_k before attn_q
        return f

    monkeypatch.setattr(gguf_file, "open_gguf", reversed_order)
    gguf_prefetch.prefetch(path)
    job, thread = gguf_prefetch._job
    thread.join()
    assert job.joined  # the gate/up buffers, from the prefetch (the load takes them)
    fetched = gguf_loader.load_gguf(path)
    assert not job.joined
    for name, a in plain.weights.items():
        if isinstance(a, QuantizedTensor):
            assert torch.equal(a.data, fetched.weights[name].data), name


def test_a_prefetch_of_another_file_is_dropped(monkeypatch):
    repacked_by_load = counted_loads(monkeypatch)
    gguf_prefetch.prefetch(os.path.join(DATA, "Q4_K.gguf"))
    job = gguf_prefetch._job[0]
    loaded = gguf_loader.load_gguf(os.path.join(DATA, "Q8_0.gguf"))
    assert gguf_prefetch._job is None
    assert job.stop
    quantized = [v for v in loaded.weights.values() if isinstance(v, QuantizedTensor)]
    assert quantized and all(v.kind == "Q8_0" for v in quantized)
    assert len(repacked_by_load) == len(quantized)  # all the load's own


def test_no_prefetch_of_a_missing_file():
    gguf_prefetch.prefetch(os.path.join(DATA, "missing.gguf"))
    assert gguf_prefetch._job is None


def test_the_prefetch_shares_torch_openmp_runtime(tmp_path):
    """quant.c's library loaded before torch must not bring the system's libgomp in as torch's."""
    if gguf_prefetch.torch_openmp() is None:
        pytest.skip("this torch ships no libgomp of its own: nothing is prefetched")
    code = (
        "import sys\n"
        "from treadle.model.loading import gguf_prefetch\n"
        f"gguf_prefetch.prefetch({os.path.join(DATA, 'Q4_K.gguf')!r})\n"
        "job, thread = gguf_prefetch._job\n"
        "thread.join()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(len(job.packed))\n"
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.splitlines()
    assert int(out[0]) > 0
    assert out[1] == repr([gguf_prefetch.torch_openmp()])


def test_serve_prefetches_the_file_it_names(monkeypatch):
    filled = []

    class Spare:
        def fill(self, prefetch=None):
            filled.append(prefetch)

    monkeypatch.setattr("treadle.server.launchers.SpareCore", Spare)
    path = os.path.join(DATA, "Q4_K.gguf")
    for argv, expected in [
        (["serve", "--model", path], path),
        (["serve", path, "--port", "8001"], path),
        (["serve", f"--model={path}"], path),
        (["serve"], None),  # the default model
        (["serve", "--model", DATA], None),  # a folder
        (["serve", "--models-dir", DATA, "--model", path], None),
    ]:
        filled.clear()
        assert cli._start_core_early(argv) is not None
        assert filled == [expected], argv


def mapped_rss(path: str) -> int:
    """Bytes of `path` this process has mapped in (its mappings' Rss in /proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if ":" not in fields[0] or not fields[0][0].isupper():  # a mapping's header line
                current = fields[5] if len(fields) > 5 else None
            elif fields[0] == "Rss:" and current == path:
                total += int(fields[1]) * 1024
    return total


def test_a_loaded_file_leaves_no_pages_mapped(tmp_path):
    """Every weight copied into its run-time form drops the file's pages under it (and those a
    read fault mapped around it): a float32 file's load would otherwise hold its weights twice."""
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_models import hf_config, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    config = hf_config("llama", tok.get_vocab_size())
    config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.head_dim = 512, 1024, 2, 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = str(tmp_path / "f32.gguf")
    write_gguf(path, "llama", model, tok)
    size = os.path.getsize(path)
    assert size > 8 << 20
    files = gguf_loader.load_gguf(path)
    weights = {name: w.float() for name, w in files.weights.items()}  # the deferred ones read now
    assert sum(w.numel() * 4 for w in weights.values()) > size // 2
    assert mapped_rss(path) <= 2 << 20, f"{mapped_rss(path)} of {size} bytes still mapped"


def test_a_served_file_answers_as_the_same_file_in_process():
    """`treadle serve FILE` (its early core repacks FILE while it imports torch) with the defaults a
    user gets (bfloat16, prefix caching): greedy answers equal an in-process LLM's on the same file,
    which loads without a prefetch."""
    import json
    import urllib.request

    from tests.support.server_process import running
    from treadle import LLM, SamplingParams
    from treadle.model.loading.default_model import default_model_path

    path = default_model_path()  # named on the command line: prefetched
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    llm = LLM(model=path, dtype="bfloat16", max_num_seqs=4)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))]
    del llm
    for server in running("--model", path, "--dtype", "bfloat16"):
        served = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
            request = urllib.request.Request(
                f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                served.append(json.load(r)["choices"][0]["text"])
        assert served == expected
