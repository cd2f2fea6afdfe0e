"""What every ``strategy=NAME`` unit is: its spec model plus what the launcher asks of it.

A strategy's file (``launcher/strategies/NAME.py``) subclasses ``StrategyUnit``
with its own fields and answers, and decorates it with ``@unit``; the registry
(``launcher.strategies``) finds the file and adds the model to the run spec's
union. The torch side lives in ``launcher/strategies/impl/NAME.py`` and is
imported only when a worker builds the strategy, so validating a config never
imports torch.

Example (a whole strategy besides its YAML and its torch side)::

    @unit
    class SoloSpec(StrategyUnit):
        name: Literal["solo"]
        impl: ClassVar[str] = "launcher.strategies.impl.solo"

        def replicas(self, cluster) -> int:
            return 1
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar

from launcher.config.base import PlanError, Strict

# A cross-field rule: ``rule(spec, cuda_devices)`` raises PlanError (see launcher.config.base.check_rules).
Rule = Callable[[Any, int], None]


class StrategyUnit(Strict):
    """The spec of one strategy, and its answers to the launcher, the plan and the CLI."""

    name: str  # each unit narrows it to Literal["its name"]: the union's discriminator

    impl: ClassVar[str] = ""  # the torch side, whose from_spec(spec, runtime) builds it (imported by build() only)
    exports: ClassVar[tuple[str, ...]] = ()  # public classes of ``impl``, reachable as launcher.distribute.NAME
    example: ClassVar[tuple[str, ...]] = ("cluster=1x1",)  # overrides giving a cluster that exercises it
    # Trainer features it cannot honour, and why: fp16-mixed, compile, activation_checkpointing, lr_schedule,
    # clip_grad_norm (checked in config/trainer.py), fused-non-adam (fused SGD/Adagrad kernels; config/recipe_rules.py) and partial-batches
    # (input.drop_remainder=false over several replicas; config/run_rules.py).
    refuses: ClassVar[dict[str, str]] = {}
    runs_scripts: ClassVar[bool] = True  # a script= can replace the recipe and loop under it

    def precision_note(self, precision: str) -> str:
        """What the strategy adds to ``trainer.precision`` in the plan's training row ("": nothing)."""
        return ""

    def refusal(self, feature: str, spec: Any) -> str | None:
        """Why it cannot honour ``feature`` in the run ``spec`` (None: it can): ``refuses``, and rules that depend
        on its own settings (``state-at-build``: an optimizer that makes its state when it is built)."""
        return self.refuses.get(feature)

    # ----- process shape -----
    def replicas(self, cluster: Any) -> int:
        """Replicas in sync: each reads its share of every global batch."""
        raise NotImplementedError

    def processes(self, cluster: Any) -> int:
        """Worker processes, the input pipelines that auto-sharding divides data among."""
        return cluster.world_size if self.replicas(cluster) > 1 else 1

    def world_size(self, cluster: Any) -> int:
        """Processes of the whole job."""
        return cluster.world_size

    def completing_ranks(self, cluster: Any) -> range:
        """The ranks whose completion is the run's (their completion markers): every process's."""
        return range(self.world_size(cluster))

    def mesh(self, cluster: Any) -> dict[str, list[Any]]:
        """The replicas' device mesh, as the plan records it."""
        return {"dims": ["replica"], "shape": [self.replicas(cluster)]}

    def launcher(self, spec: Any) -> str:
        """Which launcher starts it (launcher/launch/launchers.py): in_process, elastic or emulated."""
        c = spec.cluster
        if spec.num_processes == 1 and spec.launch.max_restarts == 0:
            return "in_process"
        return "emulated" if c.emulated else "elastic"

    # ----- validation -----
    def shape_rules(self) -> tuple[Rule, ...]:
        """Rules about the cluster it is given (run before the batch and device rules)."""
        return (no_tasks,)

    def device_rules(self) -> tuple[Rule, ...]:
        """Rules about the devices it reduces on (run after the cluster's device rules)."""
        return ()

    def named_devices(self) -> list[tuple[str, str]]:
        """(config key, device) for each device the spec names, checked to exist on this machine."""
        return []

    # ----- the plan -----
    def describe(self) -> str:
        return self.name

    def replicas_row(self, n: int) -> str:
        return f"{n} in sync"

    def own_rows(self, spec: Any, run_dir: Any) -> list[tuple[str, str]]:
        """Rows the plan adds about this strategy (before the checkpoints row)."""
        return []

    def plan_rows(self, rows: Any) -> list[tuple[str, str]]:
        """The plan's rows; ``rows`` (launcher.cli.plan.Rows) gives the standard ones and their parts."""
        return rows.standard()

    def plan_tables(self, spec: Any, run_dir: Any) -> list[Any]:
        """Tables the plan prints after its rows (rich Tables)."""
        return []

    # ----- the worker -----
    def build(self, runtime: Any) -> Any:
        """This worker's ``Strategy`` (launcher.distribute), built by ``impl``'s ``from_spec(spec, runtime)``."""
        return importlib.import_module(self.impl).from_spec(self, runtime)


# ----- rules several units share -----
def no_tasks(spec: Any, cuda: int) -> None:
    """ps and worker tasks belong to a strategy that launches tasks; the others take cluster=NxM."""
    c = spec.cluster
    for key, value in (("cluster.ps", c.ps), ("cluster.workers", c.workers)):
        if value:
            raise PlanError(key, value, f"only strategy=parameter_server has ps and worker tasks; strategy "
                                        f"{spec.strategy.name} takes its processes from cluster=NxM")


def one_replica_shape(spec: Any, cuda: int) -> None:
    """One replica on one device cannot use a cluster of several."""
    if spec.num_replicas == 1 and spec.cluster.world_size > 1:
        raise PlanError(
            "cluster", spec.cluster.shape,
            f"strategy {spec.strategy.name} runs 1 replica on 1 device, but cluster {spec.cluster.shape} "
            f"has {spec.cluster.world_size} devices; use cluster=1x1 or strategy=mirrored",
        )
