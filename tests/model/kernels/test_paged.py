"""treadle's paged attention kernel (treadle/model/kernels): the textbook definition, and a row's
bits independent of the rows, requests and threads it is computed with."""

import platform

import pytest
import torch
import torch.nn.functional as F

from treadle.model.kernels import paged as kernels
from treadle.model.layers.attention import dequantize_kv, quantize_kv

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the engine uses SDPA")

D, KV_HEADS, HEADS, BLOCK = 64, 3, 9, 16


@pytest.fixture(scope="module", params=["bf16", "int8"])
def cache(request):
    """The caches as bf16, or as int8 KV's rows (head_dim int8 values and a float32 scale)."""
    g = torch.Generator().manual_seed(0)
    shape = (64, BLOCK, KV_HEADS, D)
    k, v = torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()
    return (quantize_kv(k), quantize_kv(v)) if request.param == "int8" else (k, v)


def request(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(64, generator=g)[: -(-length // BLOCK)]
    q = torch.randn(length, HEADS, D, generator=g).bfloat16()
    return blocks, q


def reference(q, k_cache, v_cache, blocks, window=None, softcap=None, sinks=None):
    """float32 textbook attention: causal (and windowed) softmax(q k^T / sqrt(d)) v, heads grouped;
    softcap: the scores soft-capped first, softcap * tanh(s / softcap) (Gemma 2); sinks: each head's
    logit joins the softmax as one more column whose probability is dropped (gpt-oss, as
    transformers' eager attention)."""
    n = q.shape[0]
    if k_cache.dtype == torch.int8:  # the values the int8 rows stand for
        k_cache, v_cache = dequantize_kv(k_cache, torch.float32), dequantize_kv(v_cache, torch.float32)
    k = k_cache[blocks].reshape(-1, KV_HEADS, D)[:n].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v_cache[blocks].reshape(-1, KV_HEADS, D)[:n].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * D**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(-1, n, 1)
        return torch.einsum("hqk,khd->qhd", F.softmax(torch.cat([scores, column], -1), dim=-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


def run(q, k_cache, v_cache, tables, row_table, positions, window=None):
    key_end = positions + 1
    key_begin = (key_end - window).clamp(min=0) if window else torch.zeros_like(key_end)
    return kernels.paged_attention(q, k_cache, v_cache, tables, row_table, key_begin, key_end, D**-0.5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 37])
def test_matches_textbook_attention(cache, window):
    k_cache, v_cache = cache
    blocks, q = request(150, seed=1)
    out = run(q, k_cache, v_cache, blocks[None], torch.zeros(150, dtype=torch.long), torch.arange(150), window)
    want = reference(q, k_cache, v_cache, blocks, window)
    # the output is rounded to bf16: within two of its ulps of the float32 answer
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-7)


@needs_kernel
def test_soft_capped_scores_match_textbook_attention(cache):
    k_cache, v_cache = cache
    blocks, q = request(100, seed=4)
    q = q * 4  # scores of several units: the cap (1.5) bends them
    positions = torch.arange(100)
    out = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        blocks[None],
        torch.zeros(100, dtype=torch.long),
        torch.zeros(100, dtype=torch.long),
        positions + 1,
        D**-0.5,
        softcap=1.5,
    )
    want = reference(q, k_cache, v_cache, blocks, softcap=1.5)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-7)
    assert (want - reference(q, k_cache, v_cache, blocks)).abs().max() > 0.1  # without the cap: another answer


@needs_kernel
@pytest.mark.parametrize("window", [None, 37])
def test_attention_sinks_match_textbook_attention(cache, window):
    """gpt-oss's sinks: per query head, some far above the scores (the head attends to almost
    nothing), some far below (no effect), some among them."""
    k_cache, v_cache = cache
    blocks, q = request(120, seed=5)
    sinks = torch.tensor([8.0, -30.0, 0.5, 2.0, -1.0, 12.0, 0.0, 1.5, -4.0])
    positions = torch.arange(120)
    key_end = positions + 1
    key_begin = (key_end - window).clamp(min=0) if window else torch.zeros_like(key_end)
    zeros = torch.zeros(120, dtype=torch.long)
    out = kernels.paged_attention(q, k_cache, v_cache, blocks[None], zeros, key_begin, key_end, D**-0.5, sinks=sinks)
    want = reference(q, k_cache, v_cache, blocks, window, sinks=sinks)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-7)
    assert (want - reference(q, k_cache, v_cache, blocks, window)).abs().max() > 0.1  # without them: another answer
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_attention(q, k_cache, v_cache, blocks[None], zeros, key_begin, key_end, D**-0.5, sinks=sinks[:3])


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_company(cache):
    k_cache, v_cache = cache
    a_blocks, a_q = request(90, seed=2)
    b_blocks, b_q = request(40, seed=3)
    tables = torch.zeros(2, len(a_blocks), dtype=torch.long)
    tables[0] = a_blocks
    tables[1, : len(b_blocks)] = b_blocks
    whole = run(a_q, k_cache, v_cache, tables[:1], torch.zeros(90, dtype=torch.long), torch.arange(90))
    # the same rows as a chunk, one at a time, and mixed with another request's rows
    chunk = run(a_q[50:70], k_cache, v_cache, tables[:1], torch.zeros(20, dtype=torch.long), torch.arange(50, 70))
    assert torch.equal(chunk, whole[50:70])
    for p in (0, 17, 89):
        alone = run(a_q[p : p + 1], k_cache, v_cache, tables[:1], torch.zeros(1, dtype=torch.long), torch.tensor([p]))
        assert torch.equal(alone[0], whole[p])
    mixed_q = torch.cat([b_q[:40], a_q[60:90]])
    rows = torch.cat([torch.ones(40, dtype=torch.long), torch.zeros(30, dtype=torch.long)])
    mixed = run(mixed_q, k_cache, v_cache, tables, rows, torch.cat([torch.arange(40), torch.arange(60, 90)]))
    assert torch.equal(mixed[40:], whole[60:90])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(
            run(a_q, k_cache, v_cache, tables[:1], torch.zeros(90, dtype=torch.long), torch.arange(90)), whole
        )
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 compiler flag")
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_the_portable_code_gives_the_vector_codes_bits(kv, monkeypatch):
    """The kernel built without AVX-512 (the portable C that states the arithmetic) against the one
    this machine runs (AVX-512 where it has it): the same bits, for head sizes with and without a
    64-wide tail, groups up to 16, soft-capping, sinks, keys that do not fill 16 and prompts of many rows."""
    portable = kernels._build(("-mno-avx512f",))
    g = torch.Generator().manual_seed(7)
    cases = ((64, 3, 3, 0.0, False), (80, 2, 7, 0.0, True), (256, 1, 4, 30.0, False), (128, 1, 16, 0.0, True))
    for head_dim, kv_heads, group, softcap, with_sinks in cases:
        shape = (40, BLOCK, kv_heads, head_dim)
        k, v = (torch.randn(shape, generator=g) * 2).bfloat16(), torch.randn(shape, generator=g).bfloat16()
        if kv == "int8":
            k, v = quantize_kv(k), quantize_kv(v)
        tables = torch.randperm(40, generator=g).view(2, 20)
        rows = torch.cat([torch.zeros(5, dtype=torch.long), torch.ones(40, dtype=torch.long)])
        key_end = torch.cat([torch.tensor([1, 2, 17, 33, 300]), torch.arange(100, 140)])
        key_begin = torch.cat([torch.zeros(5, dtype=torch.long), (key_end[5:] - 37).clamp(min=0)])
        q = (torch.randn(45, kv_heads * group, head_dim, generator=g) * 3).bfloat16()
        args = (q, k, v, tables, rows, key_begin, key_end, head_dim**-0.5)
        sinks = torch.randn(kv_heads * group, generator=g) * 3 if with_sinks else None
        native = kernels.paged_attention(*args, softcap=softcap, sinks=sinks)
        monkeypatch.setattr(kernels._kernel, "lib", portable)
        assert torch.equal(
            kernels.paged_attention(*args, softcap=softcap, sinks=sinks).view(torch.int16), native.view(torch.int16)
        ), (head_dim, group)
        monkeypatch.undo()


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(50, KV_HEADS, D) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7] = 0.0  # a row of zeros has scale 0 and comes back as zeros
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, KV_HEADS, D + 4)
    back = dequantize_kv(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-6))
    assert torch.equal(back[7], x[7])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_rows_stored_in_c_are_quantize_kvs_bits(dtype):
    """The kernel path writes int8 rows with C in place; the SDPA path with torch: the same bits."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(40, 3 * KV_HEADS * D, generator=g).to(dtype) * torch.logspace(-2, 2, 40, dtype=torch.float32)[
        :, None
    ].to(dtype)
    x = qkv[:, KV_HEADS * D : 2 * KV_HEADS * D].view(40, KV_HEADS, D)  # a view, as a layer's keys are
    x[3] = 0
    slots = torch.randperm(8 * BLOCK, generator=g)[:40]
    by_c = torch.zeros(8, BLOCK, KV_HEADS, D + 4, dtype=torch.int8)
    kernels.store_int8_rows(x, by_c, slots)
    by_torch = torch.zeros_like(by_c)
    by_torch.view(-1, KV_HEADS, D + 4).index_copy_(0, slots, quantize_kv(x))
    assert torch.equal(by_c, by_torch)


@needs_kernel
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_wide_heads_in_a_mixed_pool_match_their_own_tensor(kv):
    """Gemma 4's global heads (512) as a view into a pool of mixed pages (kv_layout.py): blocks a page
    apart, not a tensor of their own. The kernel gives the textbook answer and the same bits as on
    a contiguous copy; int8 rows stored in place land where torch's indexing puts them."""
    g = torch.Generator().manual_seed(9)
    d, kvh, heads, blocks, n = 512, 1, 4, 12, 40
    row = d + (4 if kv == "int8" else 0)
    dtype = torch.int8 if kv == "int8" else torch.bfloat16
    part = BLOCK * kvh * row
    pool = torch.zeros(blocks, 3 * part, dtype=dtype)  # [k | v | another layer's rows] per page
    k_view = pool[:, :part].view(blocks, BLOCK, kvh, row)
    v_view = pool[:, part : 2 * part].view(blocks, BLOCK, kvh, row)
    slots = torch.arange(n) + BLOCK  # from block 1 on
    keys, values = torch.randn(n, kvh, d, generator=g).bfloat16(), torch.randn(n, kvh, d, generator=g).bfloat16()
    if kv == "int8":
        kernels.store_int8_rows(keys, k_view, slots)
        kernels.store_int8_rows(values, v_view, slots)
        want = torch.zeros(blocks, BLOCK, kvh, row, dtype=dtype)
        want.view(-1, kvh, row)[slots] = quantize_kv(keys)
        assert torch.equal(k_view, want) and not pool[:, 2 * part :].any()
    else:
        k_view[slots // BLOCK, slots % BLOCK] = keys
        v_view[slots // BLOCK, slots % BLOCK] = values
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    table = torch.arange(1, blocks)[None]
    key_end = torch.arange(n) + 1
    args = (table, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), key_end, d**-0.5)
    out = kernels.paged_attention(q, k_view, v_view, *args)
    assert torch.equal(out, kernels.paged_attention(q, k_view.contiguous(), v_view.contiguous(), *args))
    # batch-invariant at this width too: a chunk of the rows alone, and on one thread, gives their bits
    rows = slice(17, 29)
    alone = kernels.paged_attention(
        q[rows], k_view, v_view, table, torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long),
        key_end[rows], d**-0.5,
    )  # fmt: skip
    assert torch.equal(alone, out[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.paged_attention(q, k_view, v_view, *args), out)
    finally:
        torch.set_num_threads(threads)
    kf, vf = (dequantize_kv(t, torch.float32) if kv == "int8" else t.float() for t in (k_view, v_view))
    k = kf[1:].reshape(-1, kvh, d)[:n].repeat_interleave(heads, 1)
    v = vf[1:].reshape(-1, kvh, d)[:n].repeat_interleave(heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-7)


def rotation_tables(positions: int, half: int, turning: int):
    """float32 cos / sin [positions, half]: the first `turning` pairs turn, the rest have frequency 0
    (Gemma 4's proportional rotation)."""
    inv = torch.cat([10000.0 ** (-torch.arange(turning) / turning), torch.zeros(half - turning)])
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return angles.cos().contiguous(), angles.sin().contiguous()


@needs_kernel
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_keys_made_from_values_match_textbook_attention(kv, monkeypatch):
    """Gemma 4's attention_k_eq_v layers hold their values once; the kernel makes each key as it reads
    it, value * weight rotated at the key's index. Textbook attention with those keys (float64), the
    key cache never read (it is garbage here), a row's bits alone and in company, and the portable
    code's bits; a key past the rotary tables is an error, not a read past them."""
    g = torch.Generator().manual_seed(11)
    d, kvh, heads, n = 128, 2, 8, 70
    v = torch.randn(20, BLOCK, kvh, d, generator=g).bfloat16()
    if kv == "int8":
        v = quantize_kv(v)
    garbage = torch.full_like(v, 99 if kv == "int8" else 1e4)
    weight = (torch.rand(d, generator=g) + 0.5).contiguous()
    cos, sin = rotation_tables(96, d // 2, 16)
    blocks = torch.randperm(20, generator=g)[: -(-n // BLOCK)]
    q = (torch.randn(n, heads, d, generator=g) * 2).bfloat16()
    positions = torch.arange(n)
    zeros = torch.zeros(n, dtype=torch.long)

    def attend(q, rows, key_begin, key_end, tables=blocks[None], cos=cos, sin=sin):
        return kernels.paged_attention(
            q, garbage, v, tables, rows, key_begin, key_end, d**-0.5, key_weight=weight, rot_cos=cos, rot_sin=sin
        )

    out = attend(q, zeros, zeros, positions + 1)
    values = (dequantize_kv(v, torch.float64) if kv == "int8" else v.double())[blocks].reshape(-1, kvh, d)[:n]
    x = values * weight.double()
    c, s = cos[:n].double()[:, None], sin[:n].double()[:, None]
    h = d // 2
    keys = torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)
    k, vv = keys.repeat_interleave(heads // kvh, 1), values.repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), vv)
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7)
    unrotated = torch.einsum("qhd,khd->hqk", q.double(), x.repeat_interleave(heads // kvh, 1)) * d**-0.5
    assert (unrotated.tril() - scores.tril().nan_to_num(0)).abs().max() > 0.5  # the rotation matters here
    # a chunk of rows with another request's rows beside them: the same bits
    other = torch.randperm(20, generator=g)[:3]
    tables = torch.stack([blocks, torch.cat([other, blocks[3:]])])
    rows = torch.cat([torch.ones(5, dtype=torch.long), torch.zeros(20, dtype=torch.long)])
    mixed_q = torch.cat([q[:5].flip(0), q[40:60]])
    key_end = torch.cat([torch.arange(5) + 1, positions[40:60] + 1])
    mixed = attend(mixed_q, rows, torch.zeros(25, dtype=torch.long), key_end, tables)
    assert torch.equal(mixed[5:], out[40:60])
    portable = kernels._build(("-mno-avx512f",)) if platform.machine() in ("x86_64", "AMD64") else None
    if portable is not None:
        monkeypatch.setattr(kernels._kernel, "lib", portable)
        assert torch.equal(attend(q, zeros, zeros, positions + 1).view(torch.int16), out.view(torch.int16))
        monkeypatch.undo()
    with pytest.raises(RuntimeError, match="error -3"):
        attend(q, zeros, zeros, positions + 1, cos=cos[:50].contiguous(), sin=sin[:50].contiguous())


def test_without_a_compiler_the_engine_runs_on_sdpa_and_says_so(tmp_path):
    """No C compiler (CC=false, empty kernel cache): bfloat16 still serves, not batch-invariant, with
    the quantized weights dequantized at load."""
    import os
    import subprocess
    import sys

    script = (
        "from treadle import LLM, SamplingParams\n"
        "llm = LLM(dtype='bfloat16')\n"
        "out = llm.generate(['Hello'], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids\n"
        "print('invariant', llm.stats()['batch_invariant'], 'tokens', len(out))\n"
        "print('types', sorted(llm.stats()['memory']['weights_by_type']))\n"
        "try:\n"
        "    LLM(dtype='bfloat16', batch_invariant=True)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "invariant False tokens 4" in done.stdout
    assert "attention kernel is unavailable" in done.stderr
    # the quantized-weight kernels cannot be built either: the GGUF's blocks are dequantized at load
    assert "quantized-weight kernels are unavailable" in done.stderr and "types ['bfloat16']" in done.stdout
    # asked for explicitly, it is refused with the reason rather than quietly not held
    assert (
        "refused: batch_invariant needs treadle's attention kernel" in done.stdout
        and "could not be built" in done.stdout
    )


def test_batch_invariant_is_refused_in_float32_with_the_reason(make_llm):
    with pytest.raises(ValueError, match="attention kernel.*bfloat16, not torch.float32"):
        make_llm(dtype="float32", batch_invariant=True)
