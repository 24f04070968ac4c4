"""Mixtures of experts (moe.py) beyond the per-family reference check in test_architectures.py:
grouped expert products, quantized experts kept quantized, dense layers between sparse ones,
chunking / prefix hits / preemption, and the bf16 default's batch invariance."""

import gguf
import numpy as np
import pytest
import torch

from tests.support.reference import assert_matches_reference, greedy_continuation, hf_greedy
from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle import LLM, SamplingParams
from treadle.model.layers import moe

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 260, (int(k),), generator=g).tolist() for k in torch.randint(6, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_moe"))
    return folder, save_hf_model(folder, "qwen3_moe", seed=21)


def check_against(model, llm, batch):
    cont = greedy_continuation(llm)
    for ids, out in zip(batch, llm.generate(batch, GREEDY)):
        ref, rows = hf_greedy(model, ids, GREEDY.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


def test_each_chosen_expert_runs_once_per_layer_and_step(qwen3_moe, monkeypatch):
    """A hook on the grouped products: in every layer of every step, one product per distinct
    chosen expert (never one per token), over exactly the step's (token, choice) pairs."""
    folder, _ = qwen3_moe
    calls = []
    monkeypatch.setattr(moe, "expert_run_hook", lambda expert, rows: calls[-1][1].append((expert, rows)))
    inner = moe.run_experts

    def counted(x, chosen, *rest):
        calls.append((chosen.clone(), []))
        return inner(x, chosen, *rest)

    monkeypatch.setattr(moe, "run_experts", counted)
    llm = LLM(folder, dtype="float32", compile=False, max_model_len=128)
    llm.generate(prompts(6), GREEDY)
    assert len(calls) >= 2 * GREEDY.max_tokens  # two sparse layers, every step
    multi = 0
    for chosen, runs in calls:
        experts = [e for e, _ in runs]
        assert len(experts) == len(set(experts)), f"an expert ran twice in one layer's step: {experts}"
        assert sorted(experts) == sorted(set(chosen.flatten().tolist()))
        assert sum(rows for _, rows in runs) == chosen.numel()
        multi += any(rows > 1 for _, rows in runs)
    assert multi > len(calls) // 2  # most steps batch several tokens into one expert's product


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen3_moe", {"mlp_only_layers": [0]}),  # a dense layer before a sparse one
        ("qwen2_moe", {"decoder_sparse_step": 2}),  # layer 0 dense, layer 1 sparse with the shared expert
        ("olmoe", {"clip_qkv": 0.8}),  # q, k and v clamped
        ("qwen3_moe", {"norm_topk_prob": False}),
    ],
)
def test_config_variants_match_transformers(tmp_path, arch, overrides):
    model = save_hf_model(str(tmp_path), arch, seed=3, **overrides)
    llm = LLM(str(tmp_path), dtype="float32", compile=False, max_model_len=128)
    layers = llm.engine.runner.model.layers
    sparse = [layer.moe is not None for layer in layers]
    assert (
        sparse
        == {
            "qwen3_moe": [False, True] if "mlp_only_layers" in overrides else [True, True],
            "qwen2_moe": [False, True],
            "olmoe": [True, True],
        }[arch]
    )
    check_against(model, llm, prompts(3))


def test_chunked_prefill_prefix_hits_and_preemption_match_transformers(qwen3_moe):
    folder, model = qwen3_moe
    llm = LLM(
        folder,
        dtype="float32",
        compile=False,
        block_size=4,
        max_model_len=128,
        num_kv_blocks=40,
        max_num_batched_tokens=8,
    )
    g = torch.Generator().manual_seed(9)
    heads = [torch.randint(0, 260, (20,), generator=g).tolist() for _ in range(3)]
    batch = [h + torch.randint(0, 260, (n,), generator=g).tolist() for h in heads for n in (5, 11)]
    llm.generate(batch[::2], GREEDY)
    check_against(model, llm, batch)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 3 * 20 and stats["num_preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _dequantized_experts(path: str, model) -> None:
    """Put the file's quantized values into the transformers model (its reference is the file's
    dequantization, as for every quantized type)."""
    reader = gguf.GGUFReader(path)
    with torch.no_grad():
        for t in reader.tensors:
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                continue
            layer, name = int(t.name.split(".")[1]), t.name.split(".")[2]
            values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            block = model.model.layers[layer]
            if name.endswith("_exps"):
                experts = block.mlp.experts
                f = experts.gate_up_proj.shape[1] // 2
                if name == "ffn_gate_exps":
                    experts.gate_up_proj[:, :f] = values
                elif name == "ffn_up_exps":
                    experts.gate_up_proj[:, f:] = values
                else:
                    experts.down_proj.copy_(values)
            else:
                hf = {
                    "attn_q": "self_attn.q_proj",
                    "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj",
                }[name]
                block.get_submodule(hf).weight.copy_(values)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_quantized_experts_stay_in_the_files_bits(tmp_path, qwen3_moe, qtype):
    """A GGUF whose experts are stacked quantized tensors: held as the file's blocks (bytes by type,
    no float copy), and greedy tokens equal transformers on the blocks' dequantization."""
    folder, model = qwen3_moe
    path = str(tmp_path / "q.gguf")
    write_gguf(path, "qwen3moe", model, tiny_tokenizer(), quantize=qtype)
    reference = save_hf_model(str(tmp_path / "ref"), "qwen3_moe", seed=21)
    _dequantized_experts(path, reference)
    llm = LLM(path, dtype="float32", compile=False, max_model_len=128)
    by_type = llm.stats()["memory"]["weights_by_type"]
    cfg = model.config
    expert_values = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert by_type[qtype.name] >= expert_values // block_elems * block_bytes, by_type
    # no expert (nor projection) in float: the float32 bytes are the unquantized model's less theirs
    full = LLM(folder, dtype="float32", compile=False, max_model_len=128).stats()["memory"]["weights_by_type"][
        "float32"
    ]
    assert by_type["float32"] <= full - 4 * expert_values, (by_type, full)
    # each expert's gate and up were read into one buffer: the product's joined weight is that
    # buffer whole (a view), not a copy made at build while the parts were still held
    for layer in llm.engine.core.worker.runner.model.layers:
        for e, joined in enumerate(layer.moe.gate_up):
            assert joined._base is not None and joined.shape == joined._base.shape, e
            assert joined.shape[0] == 2 * cfg.moe_intermediate_size
    check_against(reference, llm, prompts(4))


def test_bf16_default_is_batch_invariant_with_experts(qwen3_moe):
    """The user's default (bf16, batch-invariant): a request's tokens and logprobs are the same
    alone and beside others, though its experts' products hold other tokens' rows."""
    folder, _ = qwen3_moe
    llm = LLM(folder, dtype="bfloat16", compile=False, max_model_len=128)
    assert llm.stats()["batch_invariant"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    batch = prompts(8, seed=13)
    alone = [llm.generate([p], params)[0].outputs[0] for p in batch[:3]]
    together = llm.generate(batch, params)[:3]
    for a, b in zip(alone, together):
        assert a.token_ids == b.outputs[0].token_ids
        assert a.logprobs == b.outputs[0].logprobs


def test_the_grouped_experts_compile_into_one_graph(qwen3_moe):
    """Compiled decode graphs are traced whole (fullgraph): the grouped loop is one operator
    there, and the compiled block gives the eager block's values."""
    folder, _ = qwen3_moe
    llm = LLM(folder, dtype="float32", compile=False, max_model_len=128)
    block = llm.engine.runner.model.layers[0].moe
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda h: block(h), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled(x[:2]), block(x[:2]), rtol=1e-5, atol=1e-6)
