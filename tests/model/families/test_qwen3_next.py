"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet hybrids) against transformers.

Tiny random models built here: three Gated DeltaNet layers (2 key heads serving 4 value heads)
and one gated attention layer; experts with a gated shared expert for Next (one dense layer among
them: `mlp_only_layers`) and 3.5-MoE. Decays are long-lived and every norm is randomised, so a
wrong state, order or norm convention shows in the tokens. As for Bamba (test_bamba.py), what
these tests hold is that the state follows the request: across prompt chunks, batch neighbours,
preemption, forked choices, prefix hits and rejected speculative proposals.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.hybrid import GREEDY, check, prompts, shared_heads
from tests.support.reference import hf_greedy_uncached
from tests.support.tiny_models import GATED_DELTANET_ARCHITECTURES, save_hf_model
from treadle import LLM, SamplingParams
from treadle.model.config import ModelLoadError

# prompts long enough for transformers' chunked prefill (64-token chunks) to take several chunks
LONG = dict(low=5, high=100)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for i, arch in enumerate(GATED_DELTANET_ARCHITECTURES):
        folder = str(tmp_path_factory.mktemp(arch))
        out[arch] = folder, save_hf_model(folder, arch, seed=10 + i)
    return out


@pytest.mark.parametrize("arch", GATED_DELTANET_ARCHITECTURES)
def test_matches_transformers_batched_chunked_and_preempted(models, arch):
    folder, model = models[arch]
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=160)
    cfg = llm.engine.core.model_config
    assert cfg.layer_types == ["recurrent"] * 3 + ["attention"] and cfg.recurrent
    assert (cfg.moe is None) == (arch == "qwen3_5_text")
    batch = prompts(4, seed=3, **LONG)
    check(model, llm, batch)
    assert llm.engine.runner.states == {}, "a finished request's recurrent state is dropped"
    # 8-token prompt chunks, and a pool small enough that requests are preempted and recomputed
    tight = LLM(folder, dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=8, num_kv_blocks=40)
    check(model, tight, batch)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_a_multimodal_folder_serves_its_text_model(models, tmp_path):
    """A released Qwen3.5 folder is the multimodal model: `text_config`, the text weights under
    model.language_model., a vision tower and an MTP head beside them (not read)."""
    src, model = models["qwen3_5_text"]
    weights = load_file(os.path.join(src, "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in weights.items()}  # fmt: skip
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    renamed["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads(open(os.path.join(src, "config.json")).read())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "vision_config": {"depth": 2}, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128)
    assert llm.engine.core.model_config.architecture == "qwen3_5"
    check(model, llm, prompts(2, seed=4))


def test_forked_choices_start_from_their_parents_state(models):
    folder, model = models["qwen3_next"]
    llm = LLM(folder, dtype="float32", max_model_len=128)
    batch = prompts(2, seed=5)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3))
    for ids, out in zip(batch, outs):
        ref, _ = hf_greedy_uncached(model, ids, 10)
        assert [o.token_ids for o in out.outputs] == [ref] * 3


def test_prefix_hits_restore_the_checkpointed_state(models, monkeypatch):
    """A follow-up with a cached head restores the state checkpointed where its hit ends; under
    8-token chunks and a pool that preempts, with two checkpoint slots, a hit never restores a
    state that is not its prefix's."""
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    folder, model = models["qwen3_5_text"]
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=128)
    batch = shared_heads(seed=6)
    llm.generate(batch[::2], GREEDY)
    before = llm.stats()["prefix_cache_hits"]
    check(model, llm, batch[1::2])
    assert llm.stats()["prefix_cache_hits"] - before == 3 * 32
    tight = LLM(folder, dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=8, num_kv_blocks=24,
                recurrent_checkpoints=2)  # fmt: skip
    tight.generate(batch[::2], GREEDY)
    check(model, tight, batch)
    stats = tight.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_speculative_decoding_rolls_the_state_back(models):
    folder, _ = models["qwen3_5_moe_text"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
    llm = LLM(folder, dtype="float32", max_model_len=160, speculative_config=spec)
    plain = LLM(folder, dtype="float32", max_model_len=160)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    head = [11, 12, 13, 14, 15] * 3
    seen = plain.generate([head], params)[0].outputs[0].token_ids
    # repeated tokens: this model's replies repeat a little, so some proposals are accepted and some not
    for prompt in [[7] * 40, [3, 4] * 20, head + seen + head + seen[:5], *prompts(2, seed=8)]:
        ours = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert ours == plain.generate([prompt], params)[0].outputs[0].token_ids
    stats = llm.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert llm.engine.runner.states == {} and llm.engine.runner.draft_states == {}


def test_the_states_come_out_of_the_kv_budget(models):
    folder, _ = models["qwen3_next"]
    budget = 1 << 20
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, kv_cache_memory_bytes=budget)
    cfg = llm.engine.core.model_config
    state = cfg.state_bytes(torch.float32)
    g = cfg.gdn
    assert state == 3 * (g.conv_dim * (g.d_conv - 1) * 4 + g.num_v_heads * g.head_k_dim * g.head_v_dim * 4)
    per_block = 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # one attention layer, float32
    slots = llm.engine.core.kv.checkpoints.num_slots
    assert llm.stats()["kv_blocks_total"] == (budget - (4 + slots) * state) // per_block


def test_bf16_default_is_invariant_to_batching_chunking_and_hits(models):
    folder, _ = models["qwen3_5_moe_text"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    batch = prompts(5, seed=11, **LONG)
    llm = LLM(folder, dtype="bfloat16", max_model_len=160)
    assert llm.stats()["batch_invariant"]
    alone = [llm.generate([p], params)[0].outputs[0] for p in batch[:2]]
    chunked = LLM(folder, dtype="bfloat16", max_model_len=160, max_num_batched_tokens=7, block_size=4)
    for run in (llm.generate(batch, params), chunked.generate(batch, params), chunked.generate(batch, params)):
        for a, b in zip(alone, run):
            assert (a.token_ids, a.logprobs) == (b.outputs[0].token_ids, b.outputs[0].logprobs)
    assert chunked.stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_scan_equals_the_torch_loop_and_value_head_orders_agree(dtype):
    """The C kernel (convolution and rule) against the layer's torch operations, with checkpoint
    copies at offsets inside segments, in float32 and in bfloat16 (the conv's output rounded as a
    bf16 model rounds it); and a layer whose per-value-head weights are permuted to llama.cpp's
    "tiled" order computes the grouped layer's outputs in that order."""
    from treadle.model.families.llama import LayerWeights
    from treadle.model.kernels import recurrent_scan
    from treadle.model.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
    from treadle.model.layers.recurrent import RecurrentState, Segment

    nk, nv, d, h = 2, 6, 8, 32
    g = torch.Generator().manual_seed(0)

    def weights(cfg):
        """Random HF weights; for "tiled", value heads p = i * nk + k of the grouped j = k * r + i."""
        w = {
            n: torch.randn(shape, generator=g) * 0.3
            for n, shape in {
                "in_proj_qkv.weight": (cfg.conv_dim, h),
                "in_proj_z.weight": (cfg.value_dim, h),
                "in_proj_b.weight": (nv, h),
                "in_proj_a.weight": (nv, h),
                "conv1d.weight": (cfg.conv_dim, 1, 4),
                "dt_bias": (nv,),
                "A_log": (nv,),
                "norm.weight": (d,),
                "out_proj.weight": (h, cfg.value_dim),
            }.items()
        }
        return w  # fmt: skip

    grouped = GatedDeltaNetConfig(nk, nv, d, d)
    tiled = GatedDeltaNetConfig(nk, nv, d, d, v_order="tiled")
    raw = weights(grouped)
    r = nv // nk
    perm = torch.arange(nv).view(nk, r).t().reshape(-1)  # tiled position p holds grouped head perm[p]
    rows = torch.cat([torch.arange(2 * nk * d), 2 * nk * d + (perm[:, None] * d + torch.arange(d)).reshape(-1)])
    value_rows = (perm[:, None] * d + torch.arange(d)).reshape(-1)
    raw_tiled = dict(raw, **{
        "in_proj_qkv.weight": raw["in_proj_qkv.weight"][rows], "in_proj_z.weight": raw["in_proj_z.weight"][value_rows],
        "in_proj_b.weight": raw["in_proj_b.weight"][perm], "in_proj_a.weight": raw["in_proj_a.weight"][perm],
        "conv1d.weight": raw["conv1d.weight"][rows], "dt_bias": raw["dt_bias"][perm], "A_log": raw["A_log"][perm],
        "out_proj.weight": raw["out_proj.weight"][:, value_rows]})  # fmt: skip

    def layer(cfg, w):
        lw = LayerWeights({f"linear_attn.{k}": v.clone() for k, v in w.items()}, "", dtype, "cpu", None)
        return GatedDeltaNet(cfg, lw, index=0)

    x = torch.randn(23, h, generator=g).to(dtype)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)

    def run(mixer, cfg, use_kernel: bool):
        state = RecurrentState.zeros(cfg, 1, torch.float32, "cpu")
        other = RecurrentState.zeros(cfg, 1, torch.float32, "cpu")
        checkpoint = RecurrentState.zeros(cfg, 1, torch.float32, "cpu")
        segments = [Segment(0, 9, state, [(4, checkpoint)]), Segment(9, 14, other)]
        original = recurrent_scan.gated_delta_net
        if not use_kernel:
            recurrent_scan.gated_delta_net = lambda *a: False
        try:
            first = mixer(x, segments)
            second = mixer(x[9:], [Segment(0, 14, state)])  # the first request goes on
        finally:
            recurrent_scan.gated_delta_net = original
        return first, second, state.ssm[0].clone(), checkpoint.ssm[0].clone(), checkpoint.conv[0].clone()

    assert recurrent_scan.available()
    c_run, torch_run = run(layer(grouped, raw), grouped, True), run(layer(grouped, raw), grouped, False)
    for a, b in zip(c_run, torch_run):
        torch.testing.assert_close(a, b, **tolerance)
    assert c_run[3].abs().sum() > 0 and not torch.equal(c_run[3], c_run[2])  # the checkpoint: the state after 4 rows
    tiled_run = run(layer(tiled, raw_tiled), tiled, True)
    torch.testing.assert_close(tiled_run[0], c_run[0], **tolerance)
    torch.testing.assert_close(tiled_run[2], c_run[2][perm], **tolerance)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layer_types": ["linear_attention"] * 4}, "no full_attention"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_num_key_heads": 0}, "linear_num_key_heads"),
        ({"linear_key_head_dim": "x"}, "linear_key_head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_value_head_dim": 32}, "linear_attn"),  # the weights contradict the configuration
    ],
)
def test_a_config_json_of_wrong_values_is_a_load_error(models, tmp_path, change, match):
    src, _ = models["qwen3_5_text"]
    for name in os.listdir(src):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    good = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**good, **change}))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(tmp_path), dtype="float32", max_model_len=64)


def test_admission_waits_for_a_free_state_slot(models):
    """A budget with room for two running states: five requests run two at a time (the others
    wait, as for blocks), each as transformers computes it, and every slot and block comes back."""
    folder, model = models["qwen3_next"]
    probe = LLM(folder, dtype="float32", max_model_len=64)
    state = probe.engine.core.model_config.state_bytes(torch.float32)
    budget = 3 * state + 48 * 1024
    assert budget // 2 // state == 2
    llm = LLM(folder, dtype="float32", max_model_len=64, block_size=16, kv_cache_memory_bytes=budget,
              recurrent_checkpoints=2)  # fmt: skip
    assert llm.engine.core.scheduler.max_num_seqs == 2
    seen = []
    step = llm.engine.runner.execute

    def counting(*args, **kwargs):
        seen.append(len(llm.engine.runner.states))
        return step(*args, **kwargs)

    llm.engine.runner.execute = counting
    check(model, llm, prompts(5, seed=12, high=40))
    assert max(seen) == 2 and llm.engine.runner.states == {}
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_default_budget_serves_16_users_of_a_2b_shaped_model():
    """Qwen3.5-2B's shape (24 layers, 18 of them Gated DeltaNets of 16 heads of 128 x 128): the
    default flags' budget holds at least 16 running states beside checkpoints and KV pages."""
    from types import SimpleNamespace

    from treadle.engine_config import DEFAULT_KV_CACHE_CAP_BYTES, EngineConfig
    from treadle.model.execution.worker import ModelWorker
    from treadle.model.families.qwen3_next import Qwen3NextConfig, interval_layer_types
    from treadle.model.layers.gated_deltanet import GatedDeltaNetConfig

    shape = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_layers=24, num_heads=8,
                 num_kv_heads=2, head_dim=256)  # fmt: skip
    gdn = GatedDeltaNetConfig(16, 16, 128, 128)
    cfg = Qwen3NextConfig(architecture="qwen35", **shape, layer_types=interval_layer_types(24, 4), gdn=gdn)
    worker = SimpleNamespace(config=EngineConfig(), dtype=torch.bfloat16)
    running, checkpoints = ModelWorker._state_budget(worker, cfg)
    assert running >= 16 and checkpoints >= 2
    assert (running + checkpoints) * cfg.state_bytes(torch.bfloat16) <= DEFAULT_KV_CACHE_CAP_BYTES * 3 // 4


def test_a_conversations_next_turn_hits_up_to_the_end_of_the_reply(models):
    """Turn 2 (the prompt, the reply, a new message) restores the state checkpointed at the last
    block boundary of turn 1's reply, and recomputes only the rest; the reply's trailing checkpoint
    replaces itself as it grows (one slot per running request)."""
    folder, model = models["qwen3_5_text"]
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=160)
    first = prompts(1, seed=13, low=37, high=38)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    checkpoints = llm.engine.core.kv.checkpoints
    assert len(checkpoints.slots) == 3 and checkpoints.trailing == {}  # two at the prompt's ends, one trailing
    second = first + reply + [5, 6, 7, 8, 9, 10]
    before = llm.stats()["prefix_cache_hits"]
    check(model, llm, [second])
    computed = len(first) + len(reply) - 1  # the reply's last token was sampled, never an input
    assert llm.stats()["prefix_cache_hits"] - before == computed // 4 * 4


@pytest.mark.parametrize(
    "arch, options",
    [
        ("qwen3_5_text", {}),  # tiled value heads, the MTP block skipped
        ("qwen3_5_moe_text", {"fuse_qkv": True, "fuse_gate_up_exps": True}),  # the converter's fused forms
        ("qwen3_next", {"mtp": False}),  # grouped heads, ssm_ba split at load, a dense layer between sparse ones
    ],
)
def test_gguf_files_as_llama_cpps_converter_writes_them(models, tmp_path, monkeypatch, arch, options):
    """llama.cpp's qwen3next / qwen35 / qwen35moe layouts (tests/support/qwen3_next_gguf.py, checked
    byte for byte against the converter): read back into the same model, greedy tokens as
    transformers', batched, chunked and through prefix hits on checkpointed states."""
    import gguf

    from tests.support.qwen3_next_gguf import write_gated_deltanet_gguf
    from tests.support.tiny_models import tiny_tokenizer
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    _, model = models[arch]
    path = str(tmp_path / "model.gguf")
    if "quantize" in options:
        options = {**options, "quantize": gguf.GGMLQuantizationType[options["quantize"]]}
    write_gated_deltanet_gguf(path, model, tiny_tokenizer(), **options)
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=16)
    cfg = llm.engine.core.model_config
    assert cfg.num_layers == 4 and cfg.layer_types == ["recurrent"] * 3 + ["attention"]
    assert cfg.gdn.v_order == ("grouped" if arch == "qwen3_next" else "tiled")
    assert llm.engine.runner.model.has_quantized_linears() == ("quantize" in options)
    batch = shared_heads(seed=14)
    check(model, llm, batch[::2])
    check(model, llm, batch)  # the second of each pair: its head's checkpointed state restored
    assert llm.stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_a_quantized_gguf_keeps_the_float_files_predictions(models, tmp_path, arch):
    """Q8_0 layers (as llama-quantize --pure stores them; regrouped, split and tiled rows moved as
    whole quantized rows): teacher-forced on the float32 file's greedy tokens, the distributions
    stay within Q8_0's rounding of the float file's. Measured on these tiny random models (flat
    distributions, so rounding flips many near-ties): mean KL 0.03-0.06, agreement ~70%; the same
    file with its value heads left untiled: KL 1.27, agreement 3%."""
    import gguf

    from tests.e2e.test_fast_paths import compare, forced_logprobs
    from tests.support.qwen3_next_gguf import write_gated_deltanet_gguf
    from tests.support.tiny_models import tiny_tokenizer

    _, model = models[arch]
    paths = {kind: str(tmp_path / f"{kind}.gguf") for kind in ("f32", "q8")}
    write_gated_deltanet_gguf(paths["f32"], model, tiny_tokenizer())
    write_gated_deltanet_gguf(paths["q8"], model, tiny_tokenizer(), quantize=gguf.GGMLQuantizationType.Q8_0)
    exact = LLM(paths["f32"], dtype="float32", max_model_len=128)
    quantized = LLM(paths["q8"], dtype="float32", max_model_len=128)
    assert quantized.engine.runner.model.has_quantized_linears()
    batch = prompts(6, seed=15, **LONG)
    conts = [o.outputs[0].token_ids for o in exact.generate(batch, GREEDY)]
    kl, agreement = compare(quantized, (batch, conts, forced_logprobs(exact, batch, conts)))
    assert kl < 0.2 and agreement >= 0.5, (kl, agreement)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("ssm.group_count", None, "ssm.group_count: missing"),
        ("ssm.time_step_rank", 3, "ssm.time_step_rank"),
        ("ssm.inner_size", 48, "ssm.inner_size"),
        ("ssm.state_size", 32, "ssm.inner_size"),  # contradicts the inner size (and the tensors)
        ("attention.recurrent_layers", [True, False], "recurrent_layers"),
        ("attention.recurrent_layers", [True] * 5, "no full-attention layer"),
        ("nextn_predict_layers", 7, "nextn_predict_layers"),
        ("ssm.conv_kernel", 1000, "ssm.conv_kernel"),
    ],
)
def test_gguf_metadata_of_wrong_values_is_a_load_error(models, tmp_path, key, value, match):
    """A qwen35 file's own keys missing, contradicting each other or the tensors: a ModelLoadError
    naming the key (or the tensor), never another exception."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from tests.support.qwen3_next_gguf import write_gated_deltanet_gguf
    from tests.support.tiny_models import tiny_tokenizer

    good, bad = str(tmp_path / "good.gguf"), str(tmp_path / "bad.gguf")
    write_gated_deltanet_gguf(good, models["qwen3_5_text"][1], tiny_tokenizer())
    reader = gguf.GGUFReader(good)
    writer = gguf.GGUFWriter(bad, "qwen35")
    full = f"qwen35.{key}"
    if value is None:
        copy_with_new_metadata(reader, writer, {}, [full])
    else:
        kind = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL) if isinstance(value, list) else (
            gguf.GGUFValueType.UINT32, None)  # fmt: skip
        copy_with_new_metadata(reader, writer, {full: MetadataDetails(kind[0], value, sub_type=kind[1])}, [])
    with pytest.raises(ModelLoadError, match=match):
        LLM(bad, dtype="float32", max_model_len=64)


# ---------------------------------------------------------------- the MTP head as a draft

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


def copy_folder(src: str, dst) -> str:
    for name in os.listdir(src):
        (dst / name).write_bytes(open(os.path.join(src, name), "rb").read())
    return str(dst)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_mtp_drafts_keep_the_greedy_tokens(models, tmp_path, source):
    """A random MTP head (a folder's mtp.*, or the nextn block llama.cpp's converter writes) drafts
    through speculative decoding: the tokens are those without speculation, batched and chunked;
    every finished request's hidden states and draft KV rows are let go."""
    from tests.support.qwen3_next_gguf import add_mtp_weights, write_gated_deltanet_gguf
    from tests.support.tiny_models import tiny_tokenizer

    src, model = models["qwen3_5_moe_text"]
    if source == "folder":
        path = copy_folder(src, tmp_path)
        add_mtp_weights(path, model, seed=2)
    else:
        path = str(tmp_path / "model.gguf")
        write_gated_deltanet_gguf(path, model, tiny_tokenizer(), mtp=True, mtp_seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batch = prompts(3, seed=21, **LONG)
    plain = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_model_len=160).generate(batch, params)]
    llm = LLM(path, dtype="float32", max_model_len=160, max_num_batched_tokens=16, speculative_config=MTP)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == plain
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in batch[:1]] == plain[:1]
    stats = llm.stats()["spec_decode"]
    assert stats["method"] == "mtp" and stats["num_draft_tokens"] > 0, stats
    assert llm.engine.core.draft.hidden == {}


def test_an_mtp_head_that_knows_the_answer_is_accepted(models, tmp_path):
    """Weights built so that the head must predict the target's next token: every layer of the
    target adds nothing (its output projections zero), so its next token is a function of the
    current one, head(norm(embed(x))); the head's fc takes the embedding half, its layer adds
    nothing and its final norm is the target's, so it computes the same function of the token it
    is given. Acceptance >= 90%, and a token costs well under one target step."""
    from safetensors.torch import load_file, save_file

    from tests.support.qwen3_next_gguf import mtp_weights

    src, model = models["qwen3_5_text"]
    path = copy_folder(src, tmp_path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    head = mtp_weights(model, seed=3)
    h = model.config.hidden_size
    head["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    head["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # (1 + w) = 1: a plain RMS normalisation
    head["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        head[f"mtp.layers.0.{name}"] = torch.zeros_like(head[f"mtp.layers.0.{name}"])
    save_file({**weights, **head}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = prompts(2, seed=22)
    plain_llm = LLM(path, dtype="float32", max_model_len=160)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(batch, params)]
    llm = LLM(path, dtype="float32", max_model_len=160, speculative_config=MTP)
    steps = llm.engine.core.num_steps
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in batch] == plain
    stats = llm.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0, stats
    assert llm.engine.core.num_steps - steps < 0.5 * 2 * 32  # vs one step a token without the head


def test_mtp_needs_a_head(models):
    folder, _ = models["qwen3_5_text"]  # saved by transformers: no mtp.* weights
    with pytest.raises(Exception, match="no MTP head"):
        LLM(folder, dtype="float32", max_model_len=64, speculative_config=MTP)
