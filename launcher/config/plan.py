"""The resolved plan: what a validated run spec means on this machine, worked out once.

The parent resolves it (``Plan.resolve``) before anything starts and writes it into
the job file; workers read it (``Plan.from_job``) instead of working out the device,
backend or world size again from the spec and a count of CUDA devices.

Example::

    plan = Plan.resolve(spec, cuda_devices=0)
    plan.device_type, plan.backend, plan.world_size    # ("cpu", "gloo", 2) for cluster=1x2
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from launcher.config.base import PositiveInt, Strict


class Plan(Strict):
    """Device, backend, process and replica counts, mesh and batch arithmetic of one run."""

    device_type: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    cuda_devices: int = Field(ge=0, description="CUDA devices the parent saw when it validated the spec")
    nodes: PositiveInt
    devices_per_node: PositiveInt
    world_size: PositiveInt = Field(description="processes of the whole job (every task, for parameter_server)")
    processes: PositiveInt = Field(description="input pipelines: the processes that read data")
    replicas: PositiveInt
    mesh: dict[str, list[Any]] = Field(description="the replicas' device mesh: dims and shape")
    global_batch_size: PositiveInt
    per_replica_batch_size: int  # a script's own loop is not held to dividing the batch
    micro_batch_size: int
    grad_accum_steps: PositiveInt

    @classmethod
    def resolve(cls, spec: Any, cuda_devices: int) -> "Plan":
        """The plan of a validated ``RunSpec`` on a machine with ``cuda_devices`` visible CUDA devices."""
        unit, c = spec.strategy, spec.cluster
        return cls(
            device_type=spec.device_type(cuda_devices), backend=spec.backend(cuda_devices), cuda_devices=cuda_devices,
            nodes=c.nodes, devices_per_node=c.devices_per_node, world_size=unit.world_size(c),
            processes=spec.num_processes, replicas=spec.num_replicas, mesh=unit.mesh(c),
            global_batch_size=spec.input.global_batch_size, per_replica_batch_size=spec.per_replica_batch_size,
            micro_batch_size=spec.micro_batch_size, grad_accum_steps=spec.trainer.grad_accum_steps,
        )

    @classmethod
    def from_job(cls, job: dict) -> "Plan":
        """The plan the parent wrote into a job file (``launcher.launch.elastic.write_job``)."""
        return cls.model_validate(job["plan"])


def read_job(job: dict) -> tuple[Any, Plan]:
    """The ``RunSpec`` and ``Plan`` of a job file, as the parent resolved them.

    The spec's rules are judged against the CUDA count the parent saw (the plan's),
    so a worker accepts exactly what its parent accepted.
    """
    from launcher.config.schema import RunSpec

    plan = Plan.from_job(job)
    return RunSpec.model_validate(job["spec"], context={"cuda_devices": plan.cuda_devices}), plan
