"""A decoder layer's step in two C calls (kernels/decoder.c) gives the bits of the layer's Python,
kernel by kernel: the same tokens and the same logprobs, for every row count the C path takes."""

import pytest
import torch

from tests.support.tiny_models import save_hf_model
from treadle import LLM, SamplingParams
from treadle.model.layers.norm import RMSNorm

PROMPTS = [
    list(range(3, 40)),
    [5, 9],
    [(i * 7) % 250 + 3 for i in range(300)],
    list(range(7, 71)),
]  # 37, 2, 300, 64 rows: a first step of 403 rows, in two slices


def _generate(llm, params):
    return [
        (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
        for o in llm.generate(PROMPTS, params)
    ]


def _both_paths(llm):
    model = llm.engine.core.worker.runner.model
    stepper = model.layer_stepper()
    assert stepper is not None
    taken = []
    run = stepper.run
    stepper.run = lambda *a: taken.append(run(*a)) or taken[-1]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    c_path = _generate(llm, params)
    assert sum(taken) >= 20 and all(taken)  # every step went through C, the 403-row one in slices
    model._stepper = None
    python = _generate(llm, params)
    model._stepper = stepper
    return c_path, python


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"])
def test_the_c_layer_step_gives_the_python_bits(tmp_path, arch):
    """Llama (llama3 rope), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (each head of q and k normed),
    Mistral (a sliding window), Phi-3 (half of each head rotates, longrope), Gemma 2 (norms on the
    attention's and the MLP's outputs, soft-capped scores, a local layer) and Gemma 3 (those norms,
    q/k norms, a local layer with its own RoPE base), quantized at load to Q8_0, bfloat16 rows:
    batch of four, prompts of 2 to 300 tokens."""
    save_hf_model(str(tmp_path), arch)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="q8_0", max_model_len=400, block_size=8, max_num_seqs=4)
    if arch == "qwen2":  # transformers starts biases at zero: give them values, so that they count
        model = llm.engine.core.worker.runner.model
        g = torch.Generator().manual_seed(0)
        for layer in model.layers:
            layer.qkv.bias = (torch.randn(layer.qkv.bias.shape, generator=g) * 0.5).to(layer.qkv.bias.dtype)
        model._stepper = False
    if arch in ("qwen3", "gemma2", "gemma3"):  # and norm weights at one: give each norm its own
        model = llm.engine.core.worker.runner.model
        g = torch.Generator().manual_seed(1)
        for layer in model.layers:
            for norm in {id(n): n for n in vars(layer).values() if isinstance(n, RMSNorm)}.values():
                w = (1 + torch.randn(norm.weight.shape, generator=g) * 0.3).to(norm.weight.dtype)
                norm.weight2.copy_(torch.cat((w, w)))
    c_path, python = _both_paths(llm)
    assert c_path == python


def test_the_default_model_with_linears_in_parts_gives_the_same_bits():
    """The embedded model (Q4_1 matrices, a Q8_0 embedding), its q/k/v and gate/up each held as
    separate parts, as a file of mixed types gives them: a product per part, into its columns."""
    llm = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=4)
    model = llm.engine.core.worker.runner.model
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer in model.layers:
        (qkv,), (gate_up,) = layer.qkv.parts, layer.gate_up.parts
        layer.qkv.parts = [
            qkv.index_rows(slice(0, q)),
            qkv.index_rows(slice(q, q + kv)),
            qkv.index_rows(slice(q + kv, None)),
        ]
        half = gate_up.shape[0] // 2
        layer.gate_up.parts = [gate_up.index_rows(slice(0, half)), gate_up.index_rows(slice(half, None))]
    model._stepper = False  # decided again, over the parts
    c_path, python = _both_paths(llm)
    assert c_path == python


@pytest.mark.parametrize("arch", ["olmoe", "mixtral", "bamba"])
def test_families_the_kernel_does_not_compute_keep_their_python(tmp_path, arch):
    """Mixtures of experts (OLMoE's q/k norms over all heads too) and a hybrid with recurrent
    layers (its own residual stream) are not the kernel's layers: their steps stay in Python."""
    save_hf_model(str(tmp_path), arch)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="q8_0", max_model_len=64, max_num_seqs=2)
    assert llm.engine.core.worker.runner.model.layer_stepper() is None


def test_a_family_that_changes_the_layer_or_opts_out_keeps_its_python():
    """A subclass that overrides a method of the layer's computation, or its norms, or says
    `decoder_kernel = False`, does not qualify; the unchanged class does."""
    from treadle.model.kernels.decoder import LayerStepper

    llm = LLM(dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    model = llm.engine.core.worker.runner.model
    base = type(model)
    assert LayerStepper.for_model(model) is not None
    changes = {
        "mlp": lambda self, layer, x: base.mlp(self, layer, x),
        "attention": lambda self, *a: base.attention(self, *a),
        "residual_stream": lambda self, *a: base.residual_stream(self, *a),
        "stepper_norms": staticmethod(lambda layer: base.stepper_norms(layer)),
        "decoder_kernel": False,
    }
    try:
        for name, value in changes.items():
            model.__class__ = type("Changed", (base,), {name: value})
            assert LayerStepper.for_model(model) is None, name
    finally:
        model.__class__ = base
