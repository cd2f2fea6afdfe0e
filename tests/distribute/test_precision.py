"""A custom loop's precision from the strategy: ``strategy.autocast()``, ``grad_scaler()``, and replica threads."""

import pytest
import torch

from launcher import distribute as dl


def _autocast_dtype(_=None):
    return str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "none"


def test_replica_threads_enter_the_autocast_that_run_is_called_in(strategy):
    """Replica 0 runs on the caller's thread, in its autocast; the other threads were in none, so replicas computed
    in different dtypes."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = strategy.experimental_local_results(strategy.run(_autocast_dtype))
    assert inside == ("torch.bfloat16", "torch.bfloat16")
    assert strategy.experimental_local_results(strategy.run(_autocast_dtype)) == ("none", "none")


@pytest.mark.parametrize("precision, dtype", [("fp32", "none"), ("bf16-mixed", "torch.bfloat16"), ("fp16-mixed", "torch.float16")])
def test_the_strategy_autocasts_in_the_runs_precision(strategy, precision, dtype):
    strategy._use_precision(precision)
    assert strategy.precision == precision

    def fn():
        with strategy.autocast():
            return _autocast_dtype()

    assert strategy.experimental_local_results(strategy.run(fn)) == (dtype, dtype)
    assert strategy.grad_scaler().is_enabled() == (precision == "fp16-mixed")


def test_outside_dlaunch_the_default_strategy_is_fp32_and_its_scaler_passes_through():
    strategy = dl.get_strategy()
    assert strategy.precision == "fp32"
    with strategy.autocast():
        assert _autocast_dtype() == "none"
    scaler = strategy.grad_scaler()
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss


def test_an_unknown_precision_is_refused(strategy):
    with pytest.raises(ValueError, match="precision must be one of"):
        strategy._use_precision("bf16")
