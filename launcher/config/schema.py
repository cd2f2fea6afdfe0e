"""The validated run spec.

Hydra composes a config; these models decide whether it can run. Unknown keys
are rejected everywhere (``extra="forbid"``), and cross-field rules show their
arithmetic. Workers receive ``RunSpec.model_dump()`` and never see Hydra.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from launcher.cluster import address
from launcher.config import run_rules
from launcher.config.base import PlanError, PlanErrors, Port, PositiveInt, Strict, check_rules, passes
from launcher.config.script import ScriptSpec, script_fits
from launcher.config.trainer import (TrainerSpec, accumulation_divides, best_is_evaluated, precision_runs_here,
                                    strategy_trains_so)
from launcher.config.user_recipes import absolute_file
from launcher.distribute.input_context import COPY_STREAMS
from launcher.input import checks
from launcher.input import files as files_lib
from launcher.input.auto_shard import AutoShardPolicy
from launcher import strategies

# Every strategy's model, from its own file in launcher/strategies/ (the registry finds them).
StrategySpec = strategies.spec_union()
StrategyName = Literal[tuple(strategies.available())]  # type: ignore[valid-type]


def __getattr__(name: str) -> Any:
    """A strategy's model by its class name (``schema.MirroredSpec``), as when they were defined here."""
    found = [unit for unit in strategies.units().values() if unit.__name__ == name]
    if not found:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found[0]


# ---------- the rest of the run ----------
class TaskSpec(Strict):
    """``cluster.task``: this machine's entry in ``cluster.tasks`` (TF_CONFIG's ``task``)."""

    type: Literal["chief", "worker", "ps"] = Field(description="this task's role")
    index: Annotated[int, Field(ge=0, description="this task's position among the tasks of its type")] = 0


class ClusterSpec(Strict):
    """``cluster=NxM``: N nodes x M devices per node.

    The same cluster can be given TF_CONFIG-style instead: ``tasks`` lists the
    nodes' addresses by role (chief first, then workers) and ``task`` says which
    one this machine is. Then ``nodes`` is their count, the master is the first
    task's address, and ``node_rank`` is the task's position.
    """

    nodes: PositiveInt = Field(1, description="machines (N of cluster=NxM)")
    devices_per_node: PositiveInt = Field(1, description="devices, and so worker processes, per machine (M of cluster=NxM)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda where this machine has a CUDA GPU (those CUDA_VISIBLE_DEVICES shows), else cpu",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="process-group backend; auto: nccl on cuda, gloo on cpu")
    master_addr: str = Field("127.0.0.1", min_length=1, description="node 0's address, where the rendezvous listens")
    master_port: Port = Field(0, description="0 picks a free port (one machine only)")
    node_rank: Annotated[int, Field(ge=0)] | None = Field(
        None, description="this machine's node; unset with nodes > 1: every node is emulated on this machine",
    )
    tasks: dict[Literal["chief", "worker", "ps"], list[Annotated[str, Field(min_length=1)]]] | None = Field(
        None, description="TF_CONFIG-style: each role's host:port list, chief first (instead of NxM)",
    )
    task: TaskSpec | None = Field(None, description="with tasks: which of them this machine is")
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

    def ranks_of(self, node: int) -> str:
        """Node ``node``'s global ranks (group rank = node rank): ``ranks 2-3``, or ``rank 1`` with one device each."""
        first, last = node * self.devices_per_node, (node + 1) * self.devices_per_node - 1
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    def node_hosts(self) -> list[str] | None:
        """Each node's host, when the cluster was given as a task list."""
        if not self.tasks:
            return None
        return [address.split_address(a)[0] for a in address.ordered_tasks(self.tasks)]


SHOWN_FILES = 5  # files at fault named one by one; the rest counted


class InputSpec(Strict):
    global_batch_size: PositiveInt = Field(32, description="examples per step over every replica (each gets an equal share)")
    shuffle: bool = Field(True, description="a new order of the training data each epoch (seed: input.seed, else trainer.seed)")
    drop_remainder: bool = Field(True, description="drop a last partial global batch in training")
    num_workers: Annotated[int, Field(ge=0, description="DataLoader worker processes per training process; 0 loads in it")] = 0
    files: list[str] = Field(
        default_factory=list,
        description="globs, relative to the directory dlaunch starts in; validation resolves them to absolute paths",
    )
    format: Literal["jsonl", "csv", "pt", "npy"] | None = Field(None, description="default: the files' extension")
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = Field(None, description="shuffle seed; default: trainer.seed")
    auto_shard_policy: Literal["AUTO", "FILE", "DATA", "OFF"] = Field(
        "AUTO",
        description="how input.files are split among processes (tf.data's names): FILE: its own files; DATA: every "
                    "n-th element; OFF: its block of each global batch; AUTO: FILE with a file per process, else DATA",
    )
    prefetch: Annotated[int, Field(ge=0, le=32)] = Field(1, description="steps fetched to the devices ahead of the one in use (each holds a batch in device memory)")
    copy_stream: Literal[COPY_STREAMS] = Field(
        "compute",
        description="CUDA: the stream that copies each batch to its device: compute (the step's own, queued behind the "
                    "step in flight, as a hand-written loop copies) or side (its own stream, overlapping the step in "
                    "flight; it can cost host time at every allocation until that step ends: docs/INPUT.md)",
    )

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
        resolved, errors = [], []
        for pattern in value:  # each pattern that matches no file is named
            try:
                resolved += files_lib.resolve_files(pattern, (info.context or {}).get("cwd"))
            except FileNotFoundError as exc:
                errors.append(PlanError("input.files", pattern if len(value) > 1 else value, str(exc)))
        if errors:
            raise errors[0] if len(errors) == 1 else PlanErrors(errors)
        return list(dict.fromkeys(resolved))

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
        bad = checks.file_problems(self.files, self.file_format)
        more = f" (and {len(bad) - SHOWN_FILES} more of the {len(self.files)} files fail too)" if len(bad) > SHOWN_FILES else ""
        shown = [PlanError("input.files", path, f"{path} {why}{more if i == SHOWN_FILES - 1 else ''}")
                 for i, (path, why) in enumerate(bad[:SHOWN_FILES])]
        if shown:
            raise shown[0] if len(shown) == 1 else PlanErrors(shown)
        return self

    @property
    def file_format(self) -> str | None:
        """``format``, or the one the files' extension names; None without files."""
        return (self.format or files_lib.infer_format(self.files)) if self.files else None

    @property
    def policy(self) -> AutoShardPolicy:
        return AutoShardPolicy[self.auto_shard_policy]


class LaunchSpec(Strict):
    dry_run: bool = Field(False, description="print the plan and start nothing")
    max_restarts: Annotated[int, Field(ge=0, description="times every worker is started again after one fails")] = 0
    rdzv_timeout_s: PositiveInt = Field(120, description="how long nodes wait for each other at the rendezvous")
    preflight_timeout_s: PositiveInt = Field(60, description="how long each rank waits for every other before training")
    collective_timeout_s: PositiveInt = Field(300, description=(
        "a collective that takes longer is reported as hung, naming the ranks; also how often a rank still running "
        "after the others finished is named (it is waited for, not killed)"))
    monitor_interval_s: Annotated[float, Field(gt=0, le=10, description="how often the elastic agent checks its workers")] = 0.1
    shutdown_grace_s: PositiveInt = Field(5, description="after a failure, seconds the other workers have to exit before SIGKILL")
    stop_grace_s: PositiveInt = Field(25, description="after a stop signal, seconds the workers have to save a checkpoint and "
                                      "exit before SIGKILL (a scheduler's own grace, often 30 s, bounds it too)")
    warm_workers: bool = Field(True, description="local CPU workers, and the agents of emulated nodes and "
                               "parameter-server tasks and their workers, fork from a process that imported them while "
                               "dlaunch planned")


class RecipeSpec(BaseModel):
    """The recipe section; the recipe's own ``Config`` model validates the rest strictly."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, description="the recipe's name: its YAML under conf/recipe, or its file's stem")
    entry: Annotated[str, AfterValidator(absolute_file)] = Field(min_length=1, description="module name, or path to the recipe's .py file")
    strategies: list[StrategyName] = Field(default_factory=list, description="strategies the recipe declares it supports")


class SweepSpec(Strict):
    objective: str = Field("final_loss", min_length=1, description="final_loss, or a metric the recipe reports (eval_accuracy): what Optuna optimizes, and what the sweep table and dlaunch report rank by (those two, where it is not given: the first metric evaluate returns)")


class RunSpec(Strict):
    strategy: StrategySpec
    cluster: ClusterSpec = ClusterSpec()
    recipe: RecipeSpec
    trainer: TrainerSpec = TrainerSpec()
    input: InputSpec = InputSpec()
    launch: LaunchSpec = LaunchSpec()
    sweep: SweepSpec = SweepSpec()
    script: ScriptSpec | None = None
    # keys that interpolate Hydra's own config (${hydra:runtime.output_dir}): defaults here, set in Hydra's job
    _deferred: tuple[str, ...] = PrivateAttr(default=())

    @property
    def deferred(self) -> tuple[str, ...]:
        """The keys left to Hydra's job (their ``${hydra:...}`` interpolation): this spec has their defaults."""
        return self._deferred

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
        return self.strategy.processes(self.cluster)

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
        # a strategy that cannot run a script: its own rules' problems (cluster.ps=0) would be fixes that fix nothing
        moot = self.script is not None and not self.strategy.runs_scripts
        shape, device = ((), ()) if moot else (self.strategy.shape_rules(), self.strategy.device_rules())
        r = run_rules
        rules = (script_fits, *shape, r.fixed_port, r.master_here, r.recipe_supports, r.batch_divides, r.whole_batches,
                 r.files_cover_workers, r.devices_exist, r.strategy_device_exists, r.backend_fits, *device,
                 accumulation_divides, strategy_trains_so, best_is_evaluated, precision_runs_here)
        # the replicas and processes of a shape the strategy refuses are no numbers to judge the batch or files by
        skipped = (*(r.SHAPE_DEPENDENT if not passes(shape, self, cuda) else ()),
                   *(() if (info.context or {}).get("here") else (r.master_here,)))  # a worker trusts the parent's
        check_rules(tuple(rule for rule in rules if (self.script is None or rule not in r.LOOP_RULES)
                          and rule not in skipped), self, cuda)
        return self
