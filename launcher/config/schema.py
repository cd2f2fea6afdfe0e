"""The validated run spec.

Hydra composes a config; these models decide whether it can run. Unknown keys
are rejected everywhere (``extra="forbid"``), and cross-field rules show their
arithmetic. Workers receive ``RunSpec.model_dump()`` and never see Hydra.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from launcher.cluster import address
from launcher.config.base import PlanError, Port, PositiveInt, Strict, check_rules
from launcher.config.script import ScriptSpec, script_fits
from launcher.config.trainer import TrainerSpec, accumulation_divides, precision_runs_here, strategy_trains_so
from launcher.distribute.cross_device_ops import Name as CrossDeviceOpsName
from launcher.distribute.device_assignment import fit_problem
from launcher.distribute.devices import canonical_name
from launcher.input import checks
from launcher.input import files as files_lib
from launcher.input.auto_shard import AutoShardPolicy, too_few_files
from launcher.strategies import mesh_fsdp
from launcher.strategies.fsdp import FSDPOptions, FSDPSpec

# ---------- strategies (one model per registered strategy) ----------
class OneDeviceSpec(Strict):
    """``strategy=one_device``: one replica on one device."""

    name: Literal["one_device"]
    device: str | None = Field(None, description="e.g. cpu:0 or cuda:1; default: the cluster's device type, index 0")

    def replicas(self, cluster: "ClusterSpec") -> int:
        return 1

    def describe(self) -> str:
        return "one_device" + (f" on {self.device}" if self.device else "")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        return None if value is None else canonical_name(value)


class MirroredSpec(Strict):
    """``strategy=mirrored``: synchronous data parallelism, one process per device (DDP)."""

    name: Literal["mirrored"]
    bucket_cap_mb: float = Field(25.0, gt=0, le=4096, description="DDP gradient bucket size")
    gradient_as_bucket_view: bool = True
    find_unused_parameters: bool = False
    cross_device_ops: CrossDeviceOpsName | None = Field(
        None, description=(
            "how gradients and reduce() combine replicas; null: shared memory between CPU processes "
            "of one machine, else DDP's own all-reduce"
        )
    )

    def replicas(self, cluster: "ClusterSpec") -> int:
        return cluster.world_size

    def describe(self) -> str:
        return f"{self.name} ({self._reduction()}, {self.bucket_cap_mb:g} MB buckets)"

    def _reduction(self) -> str:
        if self.cross_device_ops is None:
            return "DDP all-reduce, through shared memory on one CPU machine"
        return f"DDP + cross_device_ops {self.cross_device_ops}"

    def ddp_options(self) -> dict:
        """Keyword arguments for ``DistributedDataParallel``."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "find_unused_parameters": self.find_unused_parameters,
        }


class MultiWorkerMirroredSpec(MirroredSpec):
    """``strategy=multi_worker_mirrored``: mirrored across workers (processes, and later nodes)."""

    name: Literal["multi_worker_mirrored"]  # type: ignore[assignment]


class CentralStorageSpec(Strict):
    """``strategy=central_storage``: parameters stored once, compute replicated over devices of one process."""

    name: Literal["central_storage"]
    compute_devices: list[str] | None = Field(
        None, min_length=1, description="replica devices, e.g. [cpu:0,cpu:1] or [cuda:0,cuda:1]; null: one of the cluster's type",
    )
    parameter_device: str | None = Field(
        None, description="where parameters and optimizer state live; null: the only compute device, else cpu:0",
    )
    in_one_process: ClassVar[bool] = True
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "its replicas are threads of one process that share one optimizer, and GradScaler's skipped "
                      "steps are per replica; use trainer.precision=bf16-mixed (no scaler needed)",
        "compile": "its replicas are threads of one process that run views of one module; torch.compile is not "
                   "made for that; use strategy=mirrored (one process per device) to compile",
    }

    def replicas(self, cluster: "ClusterSpec") -> int:
        return len(self.compute_devices) if self.compute_devices else 1

    def describe(self) -> str:
        if not self.compute_devices:
            return f"central_storage (parameters on {self.parameter_device or 'the compute device'}, compute on the cluster's device)"
        # As CentralStorageStrategy: the only compute device, else the CPU.
        home = self.parameter_device or (self.compute_devices[0] if len(self.compute_devices) == 1 else "cpu:0")
        return f"central_storage (parameters once on {home}, compute on {', '.join(self.compute_devices)})"

    @field_validator("compute_devices")
    @classmethod
    def _known_devices(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        names = [canonical_name(v) for v in value]
        if len(set(names)) != len(names):
            raise ValueError(f"compute_devices must be distinct, got {names}")
        return names

    @field_validator("parameter_device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        return None if value is None else canonical_name(value)

    def devices(self) -> list[str]:
        """Every device it names (to check they exist)."""
        return [*(self.compute_devices or []), *([self.parameter_device] if self.parameter_device else [])]


class PartitionerSpec(Strict):
    """``strategy.partitioner``: how a large variable is split along dim 0 across ps tasks (TF's partitioners)."""

    kind: Literal["none", "fixed", "min_size", "max_size"] = Field(
        "min_size", description="none: every variable whole | fixed: num_shards | min_size / max_size: by bytes per shard",
    )
    num_shards: PositiveInt | None = Field(None, description="fixed: shards per variable (at most its rows)")
    min_shard_bytes: PositiveInt = Field(256 << 10, description="min_size: a shard holds at least this many bytes")
    max_shard_bytes: PositiveInt | None = Field(None, description="max_size: a shard holds at most this many bytes")
    max_shards: PositiveInt | None = Field(None, description="min_size: null is the number of ps tasks; max_size: null is no cap")

    @model_validator(mode="after")
    def _settings_given(self) -> "PartitionerSpec":
        if self.kind == "fixed" and self.num_shards is None:
            raise PlanError("strategy.partitioner.num_shards", None, "partitioner kind fixed needs num_shards (e.g. 4)")
        if self.kind == "max_size" and self.max_shard_bytes is None:
            raise PlanError("strategy.partitioner.max_shard_bytes", None, "partitioner kind max_size needs max_shard_bytes (e.g. 1048576)")
        return self

    def build(self, num_ps: int) -> Any:
        from launcher.distribute import partitioners

        return partitioners.from_config(
            self.kind, num_ps, num_shards=self.num_shards, min_shard_bytes=self.min_shard_bytes,
            max_shard_bytes=self.max_shard_bytes, max_shards=self.max_shards,
        )

    def describe(self) -> str:
        if self.kind == "none":
            return "variables whole"
        if self.kind == "fixed":
            return f"{self.num_shards} shards per variable"
        if self.kind == "min_size":
            return f"shards of >= {self.min_shard_bytes} bytes, at most {self.max_shards or 'one per ps'}"
        return f"shards of <= {self.max_shard_bytes} bytes" + (f", at most {self.max_shards}" if self.max_shards else "")


class ParameterServerSpec(Strict):
    """``strategy=parameter_server``: variables on ps tasks, a chief and workers that pull, compute and push (RPC)."""

    name: Literal["parameter_server"]
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the ps applies each push as it arrives | sync: one gradient per training task per step",
    )
    partitioner: PartitionerSpec = PartitionerSpec()
    rpc_timeout_s: PositiveInt = Field(60, description="an RPC to a ps that does not answer in this time fails")
    launches_tasks: ClassVar[bool] = True  # one agent per task (launch/tasks.py), not one worker group
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "the ps tasks apply the gradients, so GradScaler can neither unscale them nor skip a step; "
                      "use trainer.precision=bf16-mixed (no scaler needed)",
        "compile": "each forward pulls the variables from the ps tasks over RPC (a functional call on a meta "
                   "module), which torch.compile cannot capture",
        "lr_schedule": "the ps tasks own the optimizer and its learning rate; set recipe.optimizer.lr instead",
        "clip_grad_norm": "the ps tasks apply each task's gradient shard by shard, so no process sees the whole "
                          "gradient to clip",
    }

    def replicas(self, cluster: "ClusterSpec") -> int:
        """The training tasks (chief and workers): each reads its share of every global batch."""
        return 1 + cluster.workers

    def processes(self, cluster: "ClusterSpec") -> int:
        """The input pipelines: one per training task (ps tasks read no data)."""
        return self.replicas(cluster)

    def describe(self) -> str:
        return f"parameter_server ({self.mode}; {self.partitioner.describe()}; torch.distributed.rpc)"


class DeviceAssignmentSpec(Strict):
    """``strategy.device_assignment``: each replica's logical devices (TPU-style ``computation_shape``), and how many replicas."""

    computation_shape: list[PositiveInt] = Field(
        default_factory=lambda: [1, 1, 1, 2], min_length=1, description="a replica's block of devices; its product is the logical devices per replica",
    )
    num_replicas: PositiveInt | None = Field(None, description="null: the cluster's devices / logical devices per replica")

    @property
    def logical_devices(self) -> int:
        return math.prod(self.computation_shape)


class MeshSpec(Strict):
    """``strategy=mesh``: replicas of several logical devices each, on a 2-D DeviceMesh (replica x logical) with DTensor."""

    name: Literal["mesh"]
    device_assignment: DeviceAssignmentSpec = DeviceAssignmentSpec()
    data_parallel: Literal["replicate", "fsdp"] = Field(
        "replicate", description="the replica (dp) dim: replicate (each replica a whole copy, gradients all-reduced) "
                                 "or fsdp (FSDP2 fully_shard over the replicas: each rank holds 1/dp of its tp shard)")
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions, description="data_parallel=fsdp: how it shards, as strategy=fsdp's keys")
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "GradScaler does not unscale the split layers' DTensor gradients; use trainer.precision=bf16-mixed",
    }

    def replicas(self, cluster: "ClusterSpec") -> int:
        a = self.device_assignment
        return a.num_replicas or max(1, cluster.world_size // a.logical_devices)

    def processes(self, cluster: "ClusterSpec") -> int:
        """One process per device: every logical device of every replica."""
        return cluster.world_size

    def describe(self) -> str:
        a = self.device_assignment
        dp = f"; {mesh_fsdp.describe(self)}" if self.data_parallel == "fsdp" else ""
        return (f"mesh ({a.logical_devices} logical device(s) per replica, computation_shape {a.computation_shape}; "
                f"DeviceMesh (replica, logical), DTensor{dp})")

    def plan_rows(self, spec: Any, run_dir: Any) -> list[tuple[str, str]]:
        return mesh_fsdp.plan_rows(spec, run_dir) if self.data_parallel == "fsdp" else []


StrategySpec = Annotated[
    Union[OneDeviceSpec, MirroredSpec, MultiWorkerMirroredSpec, CentralStorageSpec, ParameterServerSpec, MeshSpec, FSDPSpec],
    Field(discriminator="name"),
]


# ---------- the rest of the run ----------
class TaskSpec(Strict):
    """``cluster.task``: this machine's entry in ``cluster.tasks`` (TF_CONFIG's ``task``)."""

    type: Literal["chief", "worker", "ps"]
    index: Annotated[int, Field(ge=0)] = 0


class ClusterSpec(Strict):
    """``cluster=NxM``: N nodes x M devices per node.

    The same cluster can be given TF_CONFIG-style instead: ``tasks`` lists the
    nodes' addresses by role (chief first, then workers) and ``task`` says which
    one this machine is. Then ``nodes`` is their count, the master is the first
    task's address, and ``node_rank`` is the task's position.
    """

    nodes: PositiveInt = 1
    devices_per_node: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: Port = Field(0, description="0 picks a free port (one machine only)")
    node_rank: Annotated[int, Field(ge=0)] | None = Field(
        None, description="this machine's node; unset with nodes > 1: every node is emulated on this machine",
    )
    tasks: dict[Literal["chief", "worker", "ps"], list[Annotated[str, Field(min_length=1)]]] | None = None
    task: TaskSpec | None = None
    token: str | None = Field(
        None, min_length=8,
        description="multi-node admission: every node gives node 0's token; null: node 0 makes one and shows it in its plan",
    )
    workers: Annotated[int, Field(ge=0)] = Field(0, description="parameter_server: worker tasks besides the chief")
    ps: Annotated[int, Field(ge=0)] = Field(0, description="parameter_server: parameter-server tasks")

    @model_validator(mode="before")
    @classmethod
    def _from_tasks(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("tasks"):
            return data
        try:
            return {**data, **address.tasks_layout(data["tasks"], data.get("task"), data.get("nodes"))}
        except address.TaskListError as exc:
            raise PlanError(exc.key, exc.value, exc.message) from None

    @field_validator("master_addr")
    @classmethod
    def _one_host(cls, value: str) -> str:
        problem = address.host_problem(value)
        if problem:
            raise PlanError("cluster.master_addr", value, f"{problem}; allowed: {address.ALLOWED}")
        return value

    @model_validator(mode="after")
    def _node_rank_fits(self) -> "ClusterSpec":
        if self.node_rank is not None and self.node_rank >= self.nodes:
            raise PlanError("cluster.node_rank", self.node_rank,
                            f"node_rank {self.node_rank} is not a node of cluster {self.shape} (0..{self.nodes - 1})")
        return self

    @property
    def shape(self) -> str:
        if self.ps:
            return f"chief + {self.workers} worker(s) + {self.ps} ps"
        return f"{self.nodes}x{self.devices_per_node}"

    def ps_tasks(self) -> list[tuple[str, int]]:
        """Every task of a parameter-server cluster, in rank order: chief, workers, ps."""
        return [("chief", 0), *(("worker", i) for i in range(self.workers)), *(("ps", i) for i in range(self.ps))]

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def emulated(self) -> bool:
        """Several nodes and no node rank: each node's agent and workers run on this machine."""
        return self.nodes > 1 and self.node_rank is None

    @property
    def loopback(self) -> bool:
        return address.is_loopback(self.master_addr)

    def node_hosts(self) -> list[str] | None:
        """Each node's host, when the cluster was given as a task list."""
        if not self.tasks:
            return None
        return [address.split_address(a)[0] for a in address.ordered_tasks(self.tasks)]


class InputSpec(Strict):
    global_batch_size: PositiveInt = 32
    shuffle: bool = True
    drop_remainder: bool = Field(True, description="drop a last partial global batch in training")
    num_workers: Annotated[int, Field(ge=0)] = 0
    files: list[str] = Field(
        default_factory=list,
        description="globs, relative to the directory dlaunch starts in; validation resolves them to absolute paths",
    )
    format: Literal["jsonl", "csv", "pt", "npy"] | None = Field(None, description="default: the files' extension")
    seed: Annotated[int, Field(ge=0)] | None = Field(None, description="shuffle seed; default: trainer.seed")
    auto_shard_policy: Literal["AUTO", "FILE", "DATA", "OFF"] = "AUTO"
    prefetch: Annotated[int, Field(ge=0)] = Field(1, description="steps fetched to the devices ahead of the one in use")

    @field_validator("auto_shard_policy", mode="before")
    @classmethod
    def _policy_name(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("files", mode="before")
    @classmethod
    def _resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        """The parent resolves the globs once; workers get the same ordered list of absolute paths."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return value  # pydantic reports the type
        try:
            return files_lib.resolve_files(value, (info.context or {}).get("cwd"))
        except FileNotFoundError as exc:
            raise PlanError("input.files", value, str(exc)) from None

    @model_validator(mode="after")
    def _format_known(self) -> "InputSpec":
        if self.files and self.format is None:
            try:
                files_lib.infer_format(self.files)
            except ValueError as exc:
                raise PlanError("input.format", None, f"{exc}; set input.format") from None
        return self

    @model_validator(mode="after")
    def _files_readable(self, info: ValidationInfo) -> "InputSpec":
        """The parent looks at each file's first bytes (``check_files`` in the context); workers read them whole."""
        if not self.files or not (info.context or {}).get("check_files"):
            return self
        bad = checks.first_problem(self.files, self.file_format)
        if bad is not None:
            path, why, count = bad
            more = f" ({count - 1} more of the {len(self.files)} files fail too)" if count > 1 else ""
            raise PlanError("input.files", path, f"{path} {why}{more}")
        return self

    @property
    def file_format(self) -> str | None:
        """``format``, or the one the files' extension names; None without files."""
        return (self.format or files_lib.infer_format(self.files)) if self.files else None

    @property
    def policy(self) -> AutoShardPolicy:
        return AutoShardPolicy[self.auto_shard_policy]


class LaunchSpec(Strict):
    dry_run: bool = False
    max_restarts: Annotated[int, Field(ge=0)] = 0
    rdzv_timeout_s: PositiveInt = Field(120, description="how long nodes wait for each other at the rendezvous")
    preflight_timeout_s: PositiveInt = Field(60, description="how long each rank waits for every other before training")
    collective_timeout_s: PositiveInt = 300
    monitor_interval_s: Annotated[float, Field(gt=0, le=10)] = 0.1
    shutdown_grace_s: PositiveInt = 5
    warm_workers: bool = Field(True, description="local CPU workers fork from a process that imported them while dlaunch planned")


class RecipeSpec(BaseModel):
    """The recipe section; the recipe's own ``Config`` model validates the rest strictly."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    entry: str = Field(min_length=1, description="module name, or path to the recipe's .py file")
    strategies: list[str] = Field(default_factory=list, description="strategies the recipe declares it supports")


class SweepSpec(Strict):
    objective: str = Field("final_loss", min_length=1, description="final_loss, or a metric the recipe reports (eval_accuracy)")


class RunSpec(Strict):
    strategy: StrategySpec
    cluster: ClusterSpec = ClusterSpec()
    recipe: RecipeSpec
    trainer: TrainerSpec = TrainerSpec()
    input: InputSpec = InputSpec()
    launch: LaunchSpec = LaunchSpec()
    sweep: SweepSpec = SweepSpec()
    script: ScriptSpec | None = None

    # ----- derived plan -----
    @property
    def num_replicas(self) -> int:
        return self.strategy.replicas(self.cluster)

    @property
    def per_replica_batch_size(self) -> int:
        return self.input.global_batch_size // self.num_replicas

    @property
    def micro_batch_size(self) -> int:
        """What one replica's forward sees: its share of the global batch, cut in ``grad_accum_steps``."""
        return self.per_replica_batch_size // self.trainer.grad_accum_steps

    @property
    def num_processes(self) -> int:
        """Worker processes, one per replica: the input pipelines that auto-sharding divides data among."""
        if hasattr(self.strategy, "processes"):
            return self.strategy.processes(self.cluster)
        return self.cluster.world_size if self.num_replicas > 1 else 1

    @property
    def input_seed(self) -> int:
        return self.trainer.seed if self.input.seed is None else self.input.seed

    def device_type(self, cuda_devices: int) -> str:
        if self.cluster.device == "auto":
            return "cuda" if cuda_devices > 0 else "cpu"
        return self.cluster.device

    def backend(self, cuda_devices: int) -> str:
        if self.cluster.backend == "auto":
            return "nccl" if self.device_type(cuda_devices) == "cuda" else "gloo"
        return self.cluster.backend

    # ----- cross-field rules -----
    @model_validator(mode="after")
    def _check_plan(self, info: ValidationInfo) -> "RunSpec":
        cuda = int((info.context or {}).get("cuda_devices", 0))
        rules = (script_fits, _ps_cluster, _mesh_fits, _one_process_shape, _one_device_shape, _fixed_port, _recipe_supports,
                 _batch_divides, _whole_batches, _files_cover_workers, _devices_exist, _strategy_device_exists, _backend_fits,
                 _shared_memory_fits, accumulation_divides, strategy_trains_so, precision_runs_here)
        check_rules(tuple(r for r in rules if self.script is None or r not in _LOOP_RULES), self, cuda)
        return self


def _ps_cluster(spec: RunSpec, cuda: int) -> None:
    """ps tasks belong to parameter_server alone; it needs at least one, and one process per task."""
    c = spec.cluster
    if spec.strategy.name != "parameter_server":
        for key, value in (("cluster.ps", c.ps), ("cluster.workers", c.workers)):
            if value:
                raise PlanError(key, value, f"only strategy=parameter_server has ps and worker tasks; strategy "
                                            f"{spec.strategy.name} takes its processes from cluster=NxM")
        return
    if c.ps < 1:
        raise PlanError("cluster.ps", c.ps, "strategy=parameter_server keeps the variables on ps tasks; give cluster.ps=1 or more "
                                            "(and cluster.workers=N for workers besides the chief)")
    if c.world_size > 1 and not c.tasks:
        raise PlanError("cluster", c.shape, f"strategy=parameter_server takes its tasks from cluster.workers and cluster.ps "
                                            f"(one process each), not from cluster={c.nodes}x{c.devices_per_node}; use cluster=1x1")
    if c.task is not None:
        count = {"chief": 1, "worker": c.workers, "ps": c.ps}[c.task.type]
        if c.task.index >= count:
            raise PlanError("cluster.task", f"{c.task.type}:{c.task.index}",
                            f"cluster.task {c.task.type}:{c.task.index} is not in cluster.tasks ({count} {c.task.type} task(s))")


def _fixed_port(spec: RunSpec, cuda: int) -> None:
    c = spec.cluster
    if c.nodes > 1 and c.node_rank is not None and c.master_port == 0:
        raise PlanError(
            "cluster.master_port", 0,
            f"cluster {c.shape} with cluster.node_rank={c.node_rank}: every node must meet at the same "
            f"address, so give a port (e.g. cluster.master_port=29500)",
        )


def _one_process_shape(spec: RunSpec, cuda: int) -> None:
    c = spec.cluster
    if getattr(spec.strategy, "in_one_process", False) and c.world_size > 1:
        raise PlanError(
            "cluster", c.shape,
            f"strategy {spec.strategy.name} runs its {spec.num_replicas} replica(s) as threads of 1 process on 1 machine, "
            f"but cluster {c.shape} = {c.nodes} node(s) x {c.devices_per_node} device(s) = {c.world_size} processes; "
            f"use cluster=1x1 and list the devices in strategy.compute_devices",
        )


def _mesh_fits(spec: RunSpec, cuda: int) -> None:
    """Replicas x logical devices must be the cluster's devices, with the arithmetic shown."""
    if spec.strategy.name != "mesh":
        return
    a, c = spec.strategy.device_assignment, spec.cluster
    where = f"cluster {c.shape} has {c.world_size}"
    if a.num_replicas is None and c.world_size % a.logical_devices:
        raise PlanError("strategy.device_assignment.computation_shape", a.computation_shape,
                        f"computation_shape {a.computation_shape} = {a.logical_devices} logical devices per replica needs "
                        f"a multiple of {a.logical_devices} devices, but {where}")
    if spec.strategy.data_parallel == "fsdp":
        problem = mesh_fsdp.fit_problem(spec.num_replicas, a.logical_devices, a.computation_shape, c.world_size, where)
    else:
        problem = fit_problem(a.computation_shape, spec.num_replicas, c.world_size, where)
        if spec.strategy.fsdp != FSDPOptions():
            raise PlanError("strategy.fsdp", spec.strategy.fsdp.model_dump(),
                            "strategy.fsdp says how data_parallel=fsdp shards; with data_parallel=replicate nothing is "
                            "sharded: set strategy.data_parallel=fsdp, or leave strategy.fsdp at its defaults")
    if problem:
        key = "strategy.device_assignment.num_replicas" if a.num_replicas else "strategy.device_assignment.computation_shape"
        raise PlanError(key, a.num_replicas or a.computation_shape, problem)


def _one_device_shape(spec: RunSpec, cuda: int) -> None:
    if hasattr(spec.strategy, "processes"):
        return
    if spec.num_replicas == 1 and spec.cluster.world_size > 1:
        raise PlanError(
            "cluster", spec.cluster.shape,
            f"strategy {spec.strategy.name} runs 1 replica on 1 device, but cluster {spec.cluster.shape} "
            f"has {spec.cluster.world_size} devices; use cluster=1x1 or strategy=mirrored",
        )


def _recipe_supports(spec: RunSpec, cuda: int) -> None:
    declared = spec.recipe.strategies
    if declared and spec.strategy.name not in declared:
        raise PlanError(
            "strategy", spec.strategy.name,
            f"recipe {spec.recipe.name} declares strategies {', '.join(declared)}; {spec.strategy.name} is not among them",
        )


def _batch_divides(spec: RunSpec, cuda: int) -> None:
    n, gbs = spec.num_replicas, spec.input.global_batch_size
    if gbs % n:
        raise PlanError(
            "input.global_batch_size", gbs,
            f"cluster {spec.cluster.shape} = {n} replicas, but global_batch_size {gbs} is not divisible by {n} "
            f"(try {_nearby_multiples(gbs, n)})",
        )


def _nearby_multiples(value: int, n: int) -> str:
    below, above = value - value % n, value + n - value % n
    return f"{below} or {above}" if below > 0 else str(above)


def _whole_batches(spec: RunSpec, cuda: int) -> None:
    if spec.num_replicas > 1 and not spec.input.drop_remainder:
        raise PlanError(
            "input.drop_remainder", False,
            f"with {spec.num_replicas} replicas a last partial global batch leaves some replicas short or empty, "
            "and averaging their mean losses would weigh examples unequally; keep input.drop_remainder=true",
        )


def _files_cover_workers(spec: RunSpec, cuda: int) -> None:
    if spec.input.auto_shard_policy != "FILE":
        return
    files, workers = len(spec.input.files), spec.num_processes
    if files == 0:
        raise PlanError(
            "input.auto_shard_policy", "FILE",
            "FILE shards input.files across workers, but input.files is not set; set input.files or use AUTO, DATA or OFF",
        )
    if files < workers:
        raise PlanError(
            "input.auto_shard_policy", "FILE",
            f"input.files matched {too_few_files(files, workers)} (cluster {spec.cluster.shape} = {workers} worker processes)",
        )


def _strategy_device_exists(spec: RunSpec, cuda: int) -> None:
    named = spec.strategy.devices() if hasattr(spec.strategy, "devices") else [getattr(spec.strategy, "device", None)]
    for device in named:
        if device is not None and device.startswith("cuda") and int(device.split(":")[1]) >= cuda:
            key = "strategy.device" if hasattr(spec.strategy, "device") else "strategy"
            raise PlanError(key, device, f"{device} was asked for, but this machine has {cuda} CUDA device(s)")


def _devices_exist(spec: RunSpec, cuda: int) -> None:
    if spec.device_type(cuda) != "cuda":
        return
    if cuda == 0:
        raise PlanError("cluster.device", "cuda", "cuda was asked for, but no CUDA device is visible; use cluster.device=cpu")
    wanted = spec.cluster.devices_per_node
    if wanted > cuda:
        raise PlanError(
            "cluster.devices_per_node", wanted,
            f"cluster {spec.cluster.shape} asks for {wanted} CUDA devices per node, but this machine has {cuda}",
        )


def _shared_memory_fits(spec: RunSpec, cuda: int) -> None:
    """``cross_device_ops=shared_memory`` reduces CPU tensors (that the processes share one machine is checked when they start)."""
    if getattr(spec.strategy, "cross_device_ops", None) != "shared_memory":
        return
    if spec.device_type(cuda) == "cuda":
        raise PlanError("strategy.cross_device_ops", "shared_memory",
                        "shared_memory reduces CPU tensors; on CUDA use null (nccl) or nccl_all_reduce")


def _backend_fits(spec: RunSpec, cuda: int) -> None:
    if spec.backend(cuda) == "nccl" and spec.device_type(cuda) != "cuda":
        raise PlanError("cluster.backend", "nccl", "nccl needs CUDA devices; use cluster.backend=gloo (or auto) on CPU")


# dlaunch's loop's rules (batch, input, trainer): a script brings its own loop, so they are not checked for it.
_LOOP_RULES = (_recipe_supports, _batch_divides, _whole_batches, _files_cover_workers, accumulation_divides,
               strategy_trains_so, precision_runs_here)
