"""``strategy=parameter_server``: variables on ps tasks; a chief and workers pull, compute and push (RPC).

Unlike the other strategies it runs no worker group: each task (chief, workers,
ps) is its own process under its own agent (the ``tasks`` launcher,
``launcher/launch/tasks.py``). The torch side is ``impl/parameter_server.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from launcher.config.base import PlanError, PositiveInt, Strict
from launcher.strategies import forward, unit
from launcher.strategies.base import Rule, StrategyUnit


class PartitionerSpec(Strict):
    """``strategy.partitioner``: how a large variable is split along dim 0 across ps tasks (TF's partitioners)."""

    kind: Literal["none", "fixed", "min_size", "max_size"] = Field(
        "min_size", description="none: every variable whole | fixed: num_shards | min_size / max_size: by bytes per shard",
    )
    num_shards: PositiveInt | None = Field(None, description="fixed: shards per variable (at most its rows)")
    min_shard_bytes: PositiveInt = Field(256 << 10, description="min_size: a variable of B bytes is cut into ceil(B / this) even shards (TF's rounding: a shard may hold less)")
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
            return (f"min_size: a variable of B bytes in ceil(B / {_kib(self.min_shard_bytes)}) even shards, at most "
                    f"{self.max_shards or 'one per ps'}")
        return f"shards of <= {_kib(self.max_shard_bytes)}" + (f", at most {self.max_shards}" if self.max_shards else "")


def _kib(n: int) -> str:
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} bytes"


@unit
class ParameterServerSpec(StrategyUnit):
    """``strategy=parameter_server``: variables on ps tasks, a chief and workers that pull, compute and push (RPC)."""

    name: Literal["parameter_server"]
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the ps applies each push as it arrives | sync: one gradient per training task per step",
    )
    partitioner: PartitionerSpec = PartitionerSpec()
    rpc_timeout_s: PositiveInt = Field(60, description="an RPC to a ps that does not answer in this time fails")
    impl: ClassVar[str] = "launcher.strategies.impl.parameter_server"
    exports: ClassVar[tuple[str, ...]] = ("ParameterServerStrategy",)
    example: ClassVar[tuple[str, ...]] = ("cluster.workers=2", "cluster.ps=2")
    runs_scripts: ClassVar[bool] = False  # the ps tasks build the model from a recipe's build()
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "the ps tasks apply the gradients, so GradScaler can neither unscale them nor skip a step; "
                      "use trainer.precision=bf16-mixed (no scaler needed)",
        "compile": "each forward pulls the variables from the ps tasks over RPC (a functional call on a meta "
                   "module), which torch.compile cannot capture",
        "activation_checkpointing": "each forward runs the module on the variables pulled for it (a functional call "
                                    "on a meta module), and a forward recomputed in backward would find only meta tensors",
        "lr_schedule": "the ps tasks own the optimizer and its learning rate; set recipe.optimizer.lr instead",
        "clip_grad_norm": "the ps tasks apply each task's gradient shard by shard, so no process sees the whole "
                          "gradient to clip",
        "pretrained": "the ps tasks build and hold the variables; load the weights in the recipe's build() "
                     "(launcher.checkpoint.read_tensors, or torch.load) instead",
        "partial-batches": "the tasks push their gradients unweighted by their rows; keep input.drop_remainder=true",
    }

    def replicas(self, cluster: Any) -> int:
        """The training tasks (chief and workers): each reads its share of every global batch."""
        return 1 + cluster.workers

    def processes(self, cluster: Any) -> int:
        """The input pipelines: one per training task (ps tasks read no data)."""
        return self.replicas(cluster)

    def world_size(self, cluster: Any) -> int:
        return len(cluster.ps_tasks())

    def completing_ranks(self, cluster: Any) -> range:
        """The chief's (rank 0): trainer.steps counts its steps; the workers and ps tasks end after it."""
        return range(1)

    def launcher(self, spec: Any) -> str:
        return "tasks"  # chief, workers and ps tasks, each its own agent

    def describe(self) -> str:
        return f"parameter_server ({self.mode}; {self.partitioner.describe()}; torch.distributed.rpc)"

    def shape_rules(self) -> tuple[Rule, ...]:
        return (ps_cluster,)

    def plan_rows(self, rows: Any) -> list[tuple[str, str]]:
        """Its tasks, their transport, and who trains on what."""
        spec = rows.spec
        c, n = spec.cluster, spec.num_replicas
        names = ", ".join(f"{kind}:{i}" for kind, i in c.ps_tasks())
        here = "all on this machine" if c.task is None else f"this machine runs {c.task.type}:{c.task.index}"
        where = "loopback only" if c.loopback else f"listening on {c.master_addr}"
        sync = self.mode == "sync"
        return [
            rows.row("strategy"), rows.row("recipe"),
            ("cluster", f"{c.shape} ({rows.plan.device_type})"),
            ("tasks", f"{names}: {here}, one torch.distributed.elastic agent each"),
            ("rpc", f"TensorPipe; endpoints meet at the chief, {c.master_addr}:{c.master_port or '<free port>'} ({where}); "
                    f"a ps silent for {self.rpc_timeout_s} s is unavailable"),
            ("training", f"{n} task(s) (chief + {c.workers} worker(s)) pull, compute, push; "
                         f"{'one update per step from all of them' if sync else 'each push applied as it arrives'}; "
                         f"a dead worker does not stop the job" + (" (async only)" if sync else "")),
            ("batch", rows.batch("task(s)")),
            rows.row("input"),
            ("steps", f"{spec.trainer.steps} global steps, counted by the chief (seed {spec.trainer.seed}, log every {spec.trainer.log_every}); "
                      + ("the loss logged is the global batch's (every task's, met at ps 0 at logged steps)" if sync else
                         "the loss logged is the chief's share's (async: no step is one global batch)")),
            rows.row("training"),
            ("checkpoints", rows.checkpoints() + ("; written by the ps tasks from their shards" if spec.trainer.checkpoint.every_steps else "")),
            *rows.resume(),
            rows.row("run dir"),
        ]

    def plan_tables(self, spec: Any, run_dir: Any) -> list[Any]:
        """Which ps task holds which variable (or shard of one), from the recipe's model built on the meta device."""
        from rich.table import Table

        from launcher.distribute.ps_placement import place_module
        from launcher.runtime.ps_task import build_variables
        from launcher.config.errors import ConfigError, Problem, UserCodeError
        from launcher.runtime.recipe_import import RecipeError
        from launcher.distribute.meta_scope import variables_scope
        from launcher.runtime.recipe import RecipeContractError

        try:
            with variables_scope():
                model, _ = build_variables(spec, run_dir)
        except RecipeContractError as exc:  # the recipe's build(), run here for the plan: exit 1, no traceback
            raise UserCodeError([Problem(key="recipe", value=spec.recipe.name, message=str(exc))]) from None
        except (ConfigError, RecipeError):  # loading the recipe, its input files: as anywhere else
            raise
        except Exception as exc:  # noqa: BLE001 - its own code failed (ctx.strategy is None here): one screen
            from launcher.runtime.recipe_import import one_line, where_raised

            raise UserCodeError([Problem(key="recipe", value=spec.recipe.name, message=(
                f"its build() raised {one_line(exc)}{where_raised(exc)}, run in the parent to place the variables on "
                "the ps tasks (there ctx.strategy is None: build the model and optimizer, no strategy calls)"))]) from None
        placement = place_module(model, spec.cluster.ps, self.partitioner.build(spec.cluster.ps))
        per_ps = ", ".join(f"ps:{k} {b / 2**20:.1f} MiB" for k, b in enumerate(placement.bytes_per_ps()))
        table = Table(title=f"variable placement ({self.partitioner.describe()}; {per_ps})", title_justify="left",
                      box=None, padding=(0, 2))
        for column in ("variable", "shape", "shard", "ps", "size"):
            table.add_column(column, justify="right" if column == "size" else "left", overflow="fold")
        for row in placement.rows():
            table.add_row(*row)
        return [table]


def ps_cluster(spec: Any, cuda: int) -> None:
    """It needs at least one ps task, and one process per task."""
    c = spec.cluster
    if c.ps < 1:
        shape = (f"; its tasks come from cluster.workers and cluster.ps, not from cluster={c.nodes}x{c.devices_per_node}: "
                 "use cluster=1x1" if c.world_size > 1 and not c.tasks else "")
        raise PlanError("cluster.ps", c.ps, "strategy=parameter_server keeps the variables on ps tasks; give cluster.ps=1 or more "
                                            f"(and cluster.workers=N for workers besides the chief){shape}")
    if c.world_size > 1 and not c.tasks:
        raise PlanError("cluster", c.shape, f"strategy=parameter_server takes its tasks from cluster.workers and cluster.ps "
                                            f"(one process each), not from cluster={c.nodes}x{c.devices_per_node}; use cluster=1x1")
    if c.task is not None:
        count = {"chief": 1, "worker": c.workers, "ps": c.ps}[c.task.type]
        if c.task.index >= count:
            raise PlanError("cluster.task", f"{c.task.type}:{c.task.index}",
                            f"cluster.task {c.task.type}:{c.task.index} is not in cluster.tasks ({count} {c.task.type} task(s))")


def cluster_def(cluster: Any) -> dict[str, list[str]]:
    """The jobs of a validated ``cluster`` section: its ``tasks``, or the chief's address and placeholders."""
    if cluster.tasks:
        return {job: list(addresses) for job, addresses in cluster.tasks.items()}
    chief = f"{cluster.master_addr}:{cluster.master_port}"
    other = f"{cluster.master_addr}:0"
    return {"chief": [chief], "worker": [other] * cluster.workers, "ps": [other] * cluster.ps}


__getattr__ = forward(__name__, ParameterServerSpec.impl)
