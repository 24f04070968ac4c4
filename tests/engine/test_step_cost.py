"""The step cost model behind the prefill cap: what it learns from step times, and the cap it gives."""

from treadle.engine.step_cost import MIN_CHUNK, StepCostModel


def test_no_cap_until_decode_and_prompt_costs_are_measured_or_when_off():
    m = StepCostModel()
    assert m.prefill_cap(1.0) is None
    m.observe(0.020, decode_rows=4, prompt_tokens=0)
    assert m.prefill_cap(1.0) is None  # a prompt token's cost is not known yet
    m.observe(0.500, decode_rows=0, prompt_tokens=1000)
    assert m.prefill_cap(1.0) == 40  # 1.0 x 20 ms / 0.5 ms per token
    assert m.prefill_cap(None) is None and m.prefill_cap(0) is None


def test_mixed_steps_charge_prompt_tokens_the_time_beyond_decoding():
    m = StepCostModel()
    m.observe(0.040, decode_rows=8, prompt_tokens=0)
    for _ in range(50):  # 8 decodes + 200 prompt tokens at 0.25 ms each
        m.observe(0.040 + 200 * 0.00025, decode_rows=8, prompt_tokens=200)
    assert abs(m.token_s - 0.00025) < 1e-6
    assert m.prefill_cap(1.0) == 160 and m.prefill_cap(0.5) == 80
    m.observe(0.041, decode_rows=8, prompt_tokens=10)  # too few prompt tokens to say anything
    assert abs(m.token_s - 0.00025) < 1e-6


def test_cap_never_below_the_minimum_chunk():
    m = StepCostModel()
    m.observe(0.001, decode_rows=1, prompt_tokens=0)
    m.observe(1.0, decode_rows=0, prompt_tokens=100)
    assert m.prefill_cap(1.0) == MIN_CHUNK


def test_a_decode_time_drift_is_followed():
    m = StepCostModel()
    m.observe(0.010, decode_rows=1, prompt_tokens=0)
    m.observe(0.100, decode_rows=0, prompt_tokens=100)
    for _ in range(60):
        m.observe(0.050, decode_rows=16, prompt_tokens=0)  # the batch grew
    assert abs(m.decode_s - 0.050) < 1e-4
    assert m.prefill_cap(1.0) in (49, 50)  # 1.0 x ~50 ms / 1 ms per token


def test_proposed_tokens_are_charged_beyond_the_decodes_at_that_batch_size():
    m = StepCostModel()
    m.observe(0.500, decode_rows=0, prompt_tokens=1000)
    assert m.draft_cost() == 3 * m.token_s  # not measured yet: three prompt tokens
    m.observe(0.040, decode_rows=4, prompt_tokens=0)
    m.observe(0.080, decode_rows=16, prompt_tokens=0)
    assert m.decode_s_at(4) == 0.040 and m.decode_s_at(16) == 0.080
    assert m.decode_s_at(2) == 0.020 and m.decode_s_at(32) == 0.080  # nearest, scaled down only
    m.observe(0.080 + 10 * 0.003, decode_rows=16, prompt_tokens=0, draft_tokens=10)
    assert abs(m.draft_cost() - 0.003) < 1e-9
    assert m.decode_s_at(16) == 0.080  # a step with proposals is not a decode-only step


def test_an_image_token_counts_as_its_prefill_and_its_encoding():
    model = StepCostModel()
    assert model.image_weight() == 1.0  # nothing measured: an image token is a prompt token
    model.observe(0.2, 0, 100)  # 2 ms a prompt token
    model.observe_images(0.6, 100)  # 6 ms of encoding per image token
    assert model.image_weight() == 4.0
    assert model.snapshot()["image_token_encode_ms"] == 6.0
