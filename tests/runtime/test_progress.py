"""The meter behind the step log: examples/s between log points, and a time left that a slow first step does not skew."""

from types import SimpleNamespace

import pytest

from launcher.runtime.progress import Meter


def test_the_time_left_goes_by_the_steps_after_the_first():
    seconds: list[float] = []
    meter = Meter(SimpleNamespace(rows_per_batch=64), total_steps=100, first_step=0, step_seconds=seconds)
    rate, eta = meter.window(1)  # step 1 is being logged: no step has ended yet
    assert eta is None and rate > 0
    seconds += [60.0, 0.5, 0.5, 1.0]  # a first step that compiled for a minute, then three steps
    _, eta = meter.window(5)
    assert eta == pytest.approx((0.5 + 0.5 + 1.0) / 3 * 95)


def test_a_resumed_command_counts_from_its_own_first_step():
    seconds = [30.0, 0.2]
    meter = Meter(SimpleNamespace(rows_per_batch=8), total_steps=60, first_step=40, step_seconds=seconds)
    _, eta = meter.window(42)
    assert eta == pytest.approx(0.2 * 18)
