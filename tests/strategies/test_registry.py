"""Building strategies from a validated spec, by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher import strategies
from launcher.config.compose import compose_and_validate


def test_unknown_strategy_lists_the_available_ones():
    class Spec:
        name = "centre"

    with pytest.raises(KeyError, match="available: central_storage, fsdp, mesh, mirrored, multi_worker_mirrored, one_device, parameter_server"):
        strategies.build(Spec(), strategies.Runtime(None, "cpu", "gloo"))


def test_an_in_process_run_ignores_rank_variables_in_the_shell(monkeypatch):
    """A parent shell with RANK/WORLD_SIZE set must not make a one-process run wait for peers."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    spec = compose_and_validate(["strategy=mirrored", "cluster=1x1"], cuda_devices=0)
    s = strategies.build(spec.strategy, strategies.Runtime(None, "cpu", "gloo"))
    assert s.num_replicas_in_sync == 1 and not dist.is_initialized()
    assert s.cluster_resolver is None



def test_a_strategy_on_the_cpu_of_a_gpu_job_autocasts_on_the_cpu(monkeypatch):
    """``strategy.device=cpu:0`` where the cluster's device is cuda: ``extended.device_type`` is the strategy's device,
    not the cluster's, and the strategy's autocast follows it. The loop's ReplicaStep and profiler now take it too
    (it took the cluster's, so bf16 on the CPU ran under a cuda autocast, in fp32); that one argument in train() is
    read, not run here: no CPU-only run has a cluster device other than the CPU."""
    spec = compose_and_validate(["strategy=one_device", "strategy.device=cpu:0", "trainer.precision=bf16-mixed"], cuda_devices=0)
    s = strategies.build(spec.strategy, strategies.Runtime(None, "cuda", "nccl"))  # the plan of a GPU machine
    assert s.extended.device_type == "cpu"
    s.precision = "bf16-mixed"
    with s.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16

# ---------- a strategy is one unit: its file, its torch side, its YAML ----------
def _python(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_validating_a_config_imports_no_torch():
    """A config error answers before torch loads: the schema, the registry and every unit are torch-free."""
    code = ("import sys, launcher.config.schema as s, launcher.strategies as r, launcher.cli.recipes; r.units(); "
            "s.RunSpec.model_validate({'strategy': {'name': 'mirrored'}, 'recipe': {'name': 'r', 'entry': 'r'}}); "
            "print('torch' in sys.modules)")
    assert _python(code) == "False"


def test_every_unit_has_its_yaml_and_its_torch_side():
    from pathlib import Path

    conf = Path(__file__).resolve().parents[2] / "conf" / "strategy"
    for name, unit in strategies.units().items():
        assert (conf / f"{name}.yaml").exists(), name
        assert unit.impl.startswith("launcher.strategies.impl."), name
        assert unit.example, name


def test_a_strategy_in_a_new_file_registers_and_validates(tmp_path):
    """Adding a strategy touches no other file: the registry finds it, the run spec accepts it, the plan asks it."""
    (tmp_path / "solo.py").write_text('''
from typing import Any, ClassVar, Literal

from launcher.strategies import unit
from launcher.strategies.base import StrategyUnit


@unit
class SoloSpec(StrategyUnit):
    name: Literal["solo"]
    impl: ClassVar[str] = "launcher.strategies.impl.one_device"
    example: ClassVar[tuple[str, ...]] = ("cluster=1x3",)

    def replicas(self, cluster: Any) -> int:
        return 3

    def describe(self) -> str:
        return "solo, three replicas"
''')
    code = f"""
import launcher.strategies as registry
registry.__path__.append({str(tmp_path)!r})
from launcher.cli import recipes_validate as recipes
from launcher.config.schema import RunSpec
spec = RunSpec.model_validate({{"strategy": {{"name": "solo"}}, "cluster": {{"devices_per_node": 3}},
                                 "recipe": {{"name": "r", "entry": "r"}}, "input": {{"global_batch_size": 9}}}})
print(spec.num_replicas, spec.num_processes, spec.strategy.describe(), recipes.STRATEGY_SHAPES["solo"], spec.strategy.launcher(spec))
"""
    assert _python(code) == "3 3 solo, three replicas ('cluster=1x3',) elastic"
