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
    strategy.precision = precision
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
        strategy.precision = "bf16"


def test_replica_threads_take_the_callers_no_grad_too(strategy):
    with torch.no_grad():
        inside = strategy.experimental_local_results(strategy.run(torch.is_grad_enabled))
    assert inside == (False, False)
    assert strategy.experimental_local_results(strategy.run(torch.is_grad_enabled)) == (True, True)


def test_replica_threads_take_the_callers_inference_mode_too(strategy):
    """An evaluation under ``torch.inference_mode()`` makes inference tensors on every replica, not on the first only."""
    def made():
        return torch.ones(1).is_inference()

    with torch.inference_mode():
        assert strategy.experimental_local_results(strategy.run(made)) == (True, True)
    assert strategy.experimental_local_results(strategy.run(made)) == (False, False)


def test_autocast_counts_as_used_only_once_entered(strategy):
    strategy.precision = "bf16-mixed"
    made = strategy.autocast()
    assert strategy._unused_precision_helpers() == ["autocast"]
    with made:
        assert strategy._unused_precision_helpers() == []


def test_a_scripts_first_step_is_one_that_trains_not_one_that_fills_the_state(caplog):
    """A script's restore builds its optimizer state with torch's get/set_state_dict, which step at lr 0: a resumed
    script was told it never entered autocast before it took a single step of its own. Its optimizer need not be
    prepared (a torchrun script's own DDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from launcher.checkpoint.state import filling_state
    from launcher.runtime.script import _watch_the_first_step

    strategy = dl.OneDeviceStrategy("cpu")
    strategy.precision = "bf16-mixed"
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    handle = _watch_the_first_step(strategy, "one_device", None)
    try:
        get_state_dict(model, optimizer)  # the user's own call: fills AdamW's state with a step at lr 0
        assert optimizer.state and not strategy.__dict__.get("_script_stepped")
        with filling_state():  # dlaunch's restore says so, whatever the lr
            optimizer.step()
        assert not strategy.__dict__.get("_script_stepped") and "has not entered" not in caplog.text
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.step()
    finally:
        handle.remove()
    assert strategy.__dict__.get("_script_stepped") and caplog.text.count("after its first optimizer step, the script "
                                                                           "has not entered strategy.autocast()") == 1


def test_an_lr_on_a_device_is_never_read_to_tell_a_filling_step():
    """Reading a CUDA tensor's value waits for the device (and fails inside a CUDA graph's capture): ``meta`` stands
    in for it here, whose value cannot be read at all."""
    from launcher.distribute.strategy import _zero

    assert not _zero(torch.zeros((), device="meta")) and _zero(torch.zeros(())) and _zero(0.0) and not _zero(None)


def test_fp16_without_a_scaler_is_named_and_the_precision_is_set_before_the_scaler():
    strategy = dl.OneDeviceStrategy("cpu")
    strategy.precision = "fp16-mixed"
    assert strategy._unused_precision_helpers() == ["autocast", "grad_scaler"]
    scaler = strategy.grad_scaler()
    assert strategy._unused_precision_helpers() == ["autocast"] and scaler.is_enabled()
    strategy.precision = "fp16-mixed"  # the same: nothing changes
    with pytest.raises(RuntimeError, match="set the precision before the first grad_scaler"):
        strategy.precision = "bf16-mixed"  # the scaler made for fp16 would stay enabled


def test_the_scaler_is_one_per_strategy_and_clipping_unscales_under_fp16():
    """A scaler made anew at each step would start at 2**16 each time and never adapt; a norm of scaled gradients
    would be 2**16 times the true one, and clip the true gradients to almost nothing."""
    strategy = dl.OneDeviceStrategy("cpu")
    strategy.precision = "fp16-mixed"
    scaler = strategy.grad_scaler()
    assert strategy.grad_scaler() is scaler and scaler.get_scale() == 2.0**16
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    true = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    model.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    torch.testing.assert_close(strategy.clip_grad_norm_(model, optimizer, None), true, rtol=1e-6, atol=0)
    torch.testing.assert_close(strategy.clip_grad_norm_(model, optimizer, None), true, rtol=1e-6, atol=0)  # once only
    scaler.step(optimizer)
    scaler.update()
