"""The observed-speed fit (app.core.step_speed) and the worker's load report of it."""

from __future__ import annotations

import pytest

from app.core.sim_timing import SimTiming
from app.core.step_speed import SPEED_FIELDS, StepSpeed, speed_fields, speed_from_load

TRUE = SimTiming(step_overhead_s=10e-3, prefill_s_per_token=100e-6, decode_s_per_sequence=150e-6)
# Steps as an engine runs them: prefill chunks with and without decodes, decode-only steps.
STEPS = [(8_192, 0), (8_000, 12), (512, 40), (0, 64), (0, 7), (3_000, 3), (64, 1), (0, 30)]


def test_the_fit_finds_a_linear_speed_from_its_steps() -> None:
    speed = StepSpeed(prior=SimTiming())  # a prior far from the truth (32 us a token)
    for _ in range(500):
        for prefill, decodes in STEPS:
            speed.observe(TRUE.step_time(prefill, decodes), prefill, decodes)
    fit = speed.estimate()
    # The ridge (a millionth of each term's own evidence) pulls towards the prior by < 0.2 %.
    assert fit.step_overhead_s == pytest.approx(10e-3, rel=2e-3)
    assert fit.prefill_s_per_token == pytest.approx(100e-6, rel=2e-3)
    assert fit.decode_s_per_sequence == pytest.approx(150e-6, rel=2e-3)
    assert speed.steps == 500 * len(STEPS)


def test_before_any_step_the_prior_is_the_answer_and_a_term_never_seen_keeps_it() -> None:
    prior = SimTiming(5e-3, 32e-6, 80e-6)
    speed = StepSpeed(prior=prior)
    fit = speed.estimate()
    fields = [fit.step_overhead_s, fit.prefill_s_per_token, fit.decode_s_per_sequence]
    assert fields == pytest.approx([5e-3, 32e-6, 80e-6], rel=1e-9)
    for _ in range(200):  # prefill-only steps of varying size: decodes never seen
        for prefill in (64, 2_048, 8_192):
            speed.observe(TRUE.step_time(prefill, 0), prefill, 0)
    fit = speed.estimate()
    assert fit.prefill_s_per_token == pytest.approx(100e-6, rel=1e-3)
    assert fit.step_overhead_s == pytest.approx(10e-3, rel=2e-3)
    assert fit.decode_s_per_sequence == pytest.approx(80e-6, rel=1e-6)


def test_a_worker_that_slows_down_is_followed() -> None:
    speed = StepSpeed(half_life_steps=100)
    slow = SimTiming(20e-3, 200e-6, 300e-6)
    for model in (TRUE, slow):
        for _ in range(300):
            for prefill, decodes in STEPS:
                speed.observe(model.step_time(prefill, decodes), prefill, decodes)
    assert speed.estimate().prefill_s_per_token == pytest.approx(200e-6, rel=1e-2)


def test_idle_and_bad_steps_are_not_observed() -> None:
    speed = StepSpeed()
    speed.observe(0.0, 0, 0)
    speed.observe(float("nan"), 100, 1)
    speed.observe(-1.0, 100, 1)
    assert speed.steps == 0
    with pytest.raises(ValueError, match="half_life_steps"):
        StepSpeed(half_life_steps=0)


def test_load_fields_round_trip() -> None:
    fields = speed_fields(TRUE, 8_192)
    assert fields == {
        "step_overhead_us": 10_000,
        "prefill_ns_per_token": 100_000,
        "decode_ns_per_sequence": 150_000,
        "max_tokens_per_step": 8_192,
    }
    assert tuple(fields) == SPEED_FIELDS
    assert speed_from_load({**fields, "waiting_requests": 3}) == (TRUE, 8_192)
    assert speed_from_load({"waiting_requests": 3}) is None
    # A speed no fit gives is no speed: the worker is costed as one that reports none.
    for name, bad in [(name, -1) for name in SPEED_FIELDS] + [("max_tokens_per_step", 0)]:
        assert speed_from_load({**fields, name: bad}) is None, name
    assert speed_from_load({**fields, "step_overhead_us": 0}) == (
        SimTiming(0.0, 100e-6, 150e-6),
        8_192,
    )


def test_a_run_of_identical_steps_counts_as_that_many() -> None:
    """Replay's coalesced decode runs: one call for k identical steps."""
    one_by_one, at_once = StepSpeed(), StepSpeed()
    for speed in (one_by_one, at_once):
        for prefill, decodes in STEPS[:4]:
            speed.observe(TRUE.step_time(prefill, decodes), prefill, decodes)
    for _ in range(50):
        one_by_one.observe(TRUE.step_time(0, 9), 0, 9)
    at_once.observe(TRUE.step_time(0, 9), 0, 9, count=50)
    assert at_once.steps == one_by_one.steps == 54
    # The run's steps are weighed as the newest (no decay among them): the fits agree closely.
    assert at_once.estimate().decode_s_per_sequence == pytest.approx(
        one_by_one.estimate().decode_s_per_sequence, rel=1e-6
    )
