"""``strategy=mesh``: replicas of several logical devices each, on a 2-D DeviceMesh (``MeshStrategy``, in ``impl/mesh.py``)."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Sequence

from pydantic import Field

from launcher.config.base import PlanError, PositiveInt, Strict
from launcher.distribute.device_assignment import fit_problem
from launcher.strategies import forward, unit
from launcher.strategies.base import Rule, StrategyUnit, no_tasks
from launcher.strategies.fsdp import FSDPOptions


class DeviceAssignmentSpec(Strict):
    """``strategy.device_assignment``: each replica's logical devices (TPU-style ``computation_shape``), and how many replicas."""

    computation_shape: list[PositiveInt] = Field(
        default_factory=lambda: [1, 1, 1, 2], min_length=1, description="a replica's block of devices; its product is the logical devices per replica",
    )
    num_replicas: PositiveInt | None = Field(None, description="null: the cluster's devices / logical devices per replica")

    @property
    def logical_devices(self) -> int:
        return math.prod(self.computation_shape)


@unit
class MeshSpec(StrategyUnit):
    """``strategy=mesh``: replicas of several logical devices each, on a 2-D DeviceMesh (replica x logical) with DTensor."""

    name: Literal["mesh"]
    device_assignment: DeviceAssignmentSpec = DeviceAssignmentSpec()
    data_parallel: Literal["replicate", "fsdp"] = Field(
        "replicate", description="the replica (dp) dim: replicate (each replica a whole copy, gradients all-reduced) "
                                 "or fsdp (FSDP2 fully_shard over the replicas: each rank holds 1/dp of its tp shard)")
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions, description="data_parallel=fsdp: how it shards, as strategy=fsdp's keys")
    impl: ClassVar[str] = "launcher.strategies.impl.mesh"
    exports: ClassVar[tuple[str, ...]] = ("MeshStrategy",)
    example: ClassVar[tuple[str, ...]] = ("cluster=1x4",)
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "GradScaler does not unscale the split layers' DTensor gradients; use trainer.precision=bf16-mixed",
        "fused-non-adam": "the split layers' parameters are DTensors, and torch's DTensor has fused kernels for Adam and "
                     "AdamW only; use recipe.optimizer.implementation=foreach",
    }

    def replicas(self, cluster: Any) -> int:
        a = self.device_assignment
        return a.num_replicas or max(1, cluster.world_size // a.logical_devices)

    def processes(self, cluster: Any) -> int:
        """One process per device: every logical device of every replica."""
        return cluster.world_size

    def mesh(self, cluster: Any) -> dict[str, list[Any]]:
        return {"dims": ["replica", "logical"], "shape": [self.replicas(cluster), self.device_assignment.logical_devices]}

    def describe(self) -> str:
        a = self.device_assignment
        dp = f"; dp: FSDP2 fully_shard over the replica dim (sharded; {self.fsdp.describe_units()})" if self.data_parallel == "fsdp" else ""
        return (f"mesh ({a.logical_devices} logical device(s) per replica, computation_shape {a.computation_shape}; "
                f"DeviceMesh (replica, logical), DTensor{dp})")

    def precision_note(self, precision: str) -> str:
        return self.fsdp.policy_note(precision) if self.data_parallel == "fsdp" else ""

    def replicas_row(self, n: int) -> str:
        logical = self.device_assignment.logical_devices
        return (f"{n} in sync, {logical} logical device(s) each: DeviceMesh {n} x {logical} (replica, logical); "
                f"rank r*{logical}+l is logical device l of replica r")

    def shape_rules(self) -> tuple[Rule, ...]:
        return (no_tasks, mesh_fits)

    def own_rows(self, spec: Any, run_dir: Any) -> list[tuple[str, str]]:
        """With data_parallel=fsdp: the mesh's dims as dp (FSDP, sharded) x tp, and fsdp's per-rank memory for dp x tp pieces."""
        if self.data_parallel != "fsdp":
            return []
        from launcher.strategies.impl.fsdp import memory_row  # builds the model on the meta device: torch

        dp, tp = spec.num_replicas, self.device_assignment.logical_devices
        how = (f"; FSDP {dp} x TP {tp}, approximate: a parameter the tensor-parallel plan leaves whole, "
               f"like RowwiseParallel's bias, is split {dp} ways only") if dp * tp > 1 else ""
        mesh = ("mesh", f"dp {dp} (replica dim: FSDP, sharded) x tp {tp} (logical dim: tensor parallel) = {dp * tp} devices")
        if spec.script is not None:  # it builds its own model, and only its workers run it
            return [mesh]
        return [mesh, ("memory", memory_row(spec, run_dir, ways=dp * tp, how=how))]


def mesh_fits(spec: Any, cuda: int) -> None:
    """Replicas x logical devices must be the cluster's devices, with the arithmetic shown."""
    a, c = spec.strategy.device_assignment, spec.cluster
    where = f"cluster {c.shape} has {c.world_size}"
    if a.num_replicas is None and c.world_size % a.logical_devices:
        raise PlanError("strategy.device_assignment.computation_shape", a.computation_shape,
                        f"computation_shape {a.computation_shape} = {a.logical_devices} logical devices per replica needs "
                        f"a multiple of {a.logical_devices} devices, but {where}")
    if spec.strategy.data_parallel == "fsdp":
        problem = fsdp_fit_problem(spec.num_replicas, a.logical_devices, a.computation_shape, c.world_size, where)
    else:
        problem = fit_problem(a.computation_shape, spec.num_replicas, c.world_size, where)
        if spec.strategy.fsdp != FSDPOptions():
            raise PlanError("strategy.fsdp", spec.strategy.fsdp.model_dump(),
                            "strategy.fsdp says how data_parallel=fsdp shards; with data_parallel=replicate nothing is "
                            "sharded: set strategy.data_parallel=fsdp, or leave strategy.fsdp at its defaults")
    if problem:
        key = "strategy.device_assignment.num_replicas" if a.num_replicas else "strategy.device_assignment.computation_shape"
        raise PlanError(key, a.num_replicas or a.computation_shape, problem)


def fsdp_fit_problem(replicas: int, logical: int, computation_shape: Sequence[int], devices: int, where: str) -> str | None:
    """Why dp x tp does not fill the cluster (None when it does), with the arithmetic."""
    if replicas * logical == devices:
        return None
    return (f"dp {replicas} x tp {logical} = {replicas * logical} devices, but {where} (dp: FSDP over "
            f"strategy.device_assignment.num_replicas; tp: the product of computation_shape {list(computation_shape)})")


__getattr__ = forward(__name__, MeshSpec.impl)
