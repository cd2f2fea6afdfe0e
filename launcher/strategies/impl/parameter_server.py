"""``ParameterServerStrategy``: variables on ps tasks; a chief and workers pull, compute and push.

As ``tf.distribute.experimental.ParameterServerStrategy`` (between-graph
replication): variables live on the ps tasks, placed round-robin, a large one
split along dim 0 by a partitioner; every training task (the chief and each
worker) runs the step on its own share of each global batch. Transport is
torch.distributed.rpc (TensorPipe).

* A forward pulls the current values of the dense variables; an embedding
  lookup pulls only the rows its ids name, so no task ever holds a whole table.
* ``optimizer.step()`` pushes the gradients (an embedding's as sparse rows); the
  ps applies them with the optimizer it holds. Async (TF's mode): each push as
  it arrives. Sync: once every training task has pushed, the mean, as
  ``SyncReplicasOptimizer`` does; the result then equals one device's with the
  same global batch.
* The global step lives on ps 0. As the seed says, the first replica of every
  training task advances it (``global_step_rule="every_worker"``; in sync mode once
  per applied step); under dlaunch only the chief's pushes do, so that it counts
  ``trainer.steps``. Workers stop when the chief is done; a worker that dies does
  not stop the job (async).
* ``reduce`` is over every training task (they meet at ps 0), as
  ``num_replicas_in_sync`` counts them.

Example (each task runs this with its own TF_CONFIG; ps tasks run ``Server(...).join()``)::

    strategy = ParameterServerStrategy(TFConfigClusterResolver(), MinSizePartitioner(256 << 10, 2))
    model = WideDeep()  # outside scope(): real values, which the chief sends to the ps tasks (in scope: meta, none)
    model, optimizer = strategy.prepare(model, torch.optim.Adagrad(model.parameters(), lr=0.05))
"""

from __future__ import annotations

import functools
import logging
import signal
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed.rpc as trpc

from launcher.cluster.env import tf_config
from launcher.cluster.resolvers import ClusterSpec, SimpleClusterResolver, TFConfigClusterResolver, validate_task
from launcher.distribute import server as ps_server
from launcher.distribute.ps_client import Client, ParameterServerUnavailable
from launcher.distribute.collectives import SingleProcess
from launcher.distribute import task_exchange
from launcher.distribute.extended import StrategyExtended, _check_same_shapes
from launcher.distribute.input_context import InputContext
from launcher.distribute.input_iterator import InputIterator
from launcher.distribute.meta_scope import MetaScope
from launcher.distribute.partitioners import Partitioner
from launcher.distribute.ps_placement import place_module
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.distribute.values import PerReplica, map_structure
from launcher.strategies import Runtime
from launcher.strategies.impl import ps_local
from launcher.strategies.impl.ps_module import PSModule, PSOptimizer, contents_for
from launcher.strategies.parameter_server import cluster_def

log = logging.getLogger("dlaunch")
TRAINING_JOBS = ("chief", "worker")


class _Tasks(SingleProcess):
    """The process level of a training task: its place among the chief and workers, and no collectives."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def _local_part(leaf: PerReplica, axis: int | None) -> tuple[torch.Tensor, int]:
    """This task's sum of a per-replica value (along ``axis`` too), and how many values it adds up."""
    parts = [torch.as_tensor(v) for v in leaf.values]
    if axis is None:
        _check_same_shapes(parts)
        return sum(parts[1:], parts[0].clone()), len(parts)
    return sum(p.sum(dim=axis) for p in parts), sum(p.shape[axis] for p in parts)


def _this_task(reduce_op: ReduceOp, leaf: Any, axis: int | None) -> Any:
    """``reduce_over="this_task"``: this task's (single) replica's value, reduced along ``axis`` only."""
    local = leaf.values[0] if isinstance(leaf, PerReplica) else leaf
    if axis is None:
        return local
    return local.sum(axis) if reduce_op is ReduceOp.SUM else local.float().mean(axis)


def _combine(reduce_op: ReduceOp, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    shapes = {tuple(t.shape) for t, _ in parts}
    if len(shapes) > 1:
        raise ValueError(f"per-replica values have different shapes across training tasks {sorted(shapes)}; pass axis= "
                         "to reduce along the batch dimension (for example with a last partial batch)")
    total = sum(t for t, _ in parts[1:]) + parts[0][0]
    return total if reduce_op is ReduceOp.SUM else total / sum(n for _, n in parts)


class _PSExtended(StrategyExtended):
    plain_values_per_process = False  # the tasks meet at ps 0 for per-replica values only (_reduce below)

    def __init__(self, device: str, position: int, training_tasks: int, strategy_args: dict):
        super().__init__([device], _Tasks(position, training_tasks))
        self._args = strategy_args
        self.client: Client | None = None
        self._said_stop = False  # a worker's stop, said once
        self._exchanges = 0  # reduce calls so far: every task makes them in the same order

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/task:{k}" for k in range(self._args["num_ps"]))

    @property
    def _gradients_averaged_over(self) -> int:
        # Sync: the ps applies the mean of every task's push; async: each push as it is.
        return self._proc.world_size if self._args["mode"] == "sync" else 1

    def _scope(self) -> Any:
        return MetaScope(super()._scope())  # variables live on the ps tasks: no values here

    def _reduce(self, reduce_op: ReduceOp, value: Any, axis: int | None) -> Any:
        """Over every training task, as ``num_replicas_in_sync`` counts them: the tasks meet at ps 0.

        The tasks share no process group, so each sends its replicas' sum (and
        count) of every per-replica leaf to ps 0 and adds up everyone's.
        """
        if self._args["reduce_over"] == "this_task":
            return map_structure(lambda leaf: _this_task(reduce_op, leaf, axis), value)
        leaves: list[PerReplica] = []
        map_structure(lambda leaf: leaves.append(leaf) if isinstance(leaf, PerReplica) else None, value)
        if not leaves or self._proc.world_size == 1:
            return super()._reduce(reduce_op, value, axis)
        mine = [_local_part(leaf, axis) for leaf in leaves]
        homes = [t.device for t, _ in mine]  # TensorPipe sends CPU tensors only (no device maps): back there after
        self._exchanges += 1
        everyone = task_exchange.exchange(self._exchanges, self._proc.rank, [(t.cpu(), n) for t, n in mine],
                                          self._proc.world_size, float(self._args["sync_timeout_s"]))
        totals = iter([_combine(reduce_op, [parts[i] for parts in everyone]).to(home) for i, home in enumerate(homes)])
        return map_structure(lambda leaf: next(totals) if isinstance(leaf, PerReplica) else self._reduce_plain(reduce_op, leaf, axis), value)

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        a = self._args
        chief = a["task"].startswith("chief")
        if chief and a["open_on_prepare"] and any(p.is_meta for p in module.parameters()):  # no ps would ever get values
            raise ValueError("ParameterServerStrategy.prepare: the chief's model is on the meta device (built inside "
                             "strategy.scope(): shapes, no values), and in a job of your own processes the chief sends "
                             "the variables' values to the ps tasks; build the model outside scope() (under dlaunch the "
                             "ps tasks build the recipe's themselves)")
        placement = place_module(module, a["num_ps"], a["partitioner"])
        client = Client(a["task"], a["num_ps"], placement, a["rpc_timeout_s"])
        client.sync, client.sync_timeout_s = a["mode"] == "sync", float(a["sync_timeout_s"])
        self.client = client
        if chief and not any(p.is_meta for p in module.parameters()) and optimizer is not None:
            for k in range(a["num_ps"]):  # the chief initializes the variables (built outside scope(): real values)
                c = contents_for(k, module, optimizer, placement)
                client.call(k, ps_server.remote_create, c, a["training_tasks"] if client.sync else None)
        if chief and a["open_on_prepare"]:
            self.open(0)
        if not chief:
            ready_s = float(a["ready_timeout_s"])
            client.global_step = max(client.each(ps_server.remote_wait_ready, ready_s, waits_s=ready_s))
        model = PSModule(module.to("meta"), client, self._devices[0])
        return model, (None if optimizer is None else PSOptimizer(optimizer, model, chief or a["global_step_rule"] == "every_worker"))

    def save_checkpoint(self, model: Any, path: Any, progress: tuple[int, int, int]) -> bool:
        model.save_to_ps(path, progress)  # each ps writes its shards
        return True

    def load_checkpoint(self, model: Any, path: Any) -> tuple[int, int, int] | None:
        self._wait_created()  # a ps that built its variables after the load would overwrite what it read
        return model.load_from_ps(path)  # each ps reads the rows it holds

    def _wait_created(self) -> None:
        ready_s = float(self._args["ready_timeout_s"])
        self.client.each(ps_server.remote_wait_created, ready_s, waits_s=ready_s)

    def open(self, global_step: int) -> None:
        """The chief's word that the variables are initialized (or restored): workers may start."""
        self._wait_created()
        self.client.each(ps_server.remote_open, int(global_step))
        self.client.global_step = int(global_step)

    def own_loop(self) -> Any:
        if not self._args["task"].startswith("worker"):
            return None
        from launcher.runtime import ps_task  # the runtime's side of a ps job (it imports this module)

        return functools.partial(ps_task.train_worker, name=self._args["task"])

    def logged_metrics(self, step: int, value: torch.Tensor) -> torch.Tensor:
        """Sync mode: every training task's metrics of logged step ``step`` meet at ps 0, and the chief gets their
        mean, the global batch's (a worker, its own). Async mode: this task's own, on its share of a batch: the
        tasks do not step together, so no step is one global batch's."""
        if self._args["mode"] != "sync" or self.client is None:
            return value
        future = trpc.rpc_async("ps:0", ps_server.remote_report, args=(int(step), value.detach().cpu(), self._proc.rank == 0),
                                timeout=float(self._args["sync_timeout_s"]))
        mean = self.client.wait(0, future)
        return value if mean is None else mean.to(value.device)

    def stop_requested(self) -> int:
        """Sync mode: the signal a worker stopped on (the job needs every worker: the chief stops and saves)."""
        signum = self.client.stop_signal if self.client else 0
        if signum and not self._said_stop:
            self._said_stop = True
            log.warning("a worker stopped on %s; a sync job needs every worker, so the chief stops too, after its save",
                        signal.Signals(signum).name)
        return signum

    def _client(self) -> Client:
        """The client ``prepare`` made, or one without variables: a task that never prepares (a coordinator, a
        worker with nothing to train) still tells the ps tasks that it ends."""
        a = self._args
        return self.client or Client(a["task"], a["num_ps"], None, a["rpc_timeout_s"])

    def finish(self) -> None:
        """The chief is done: the ps tasks tell the workers to stop at their next push, then end."""
        try:
            self._client().each(ps_server.remote_finish)
        except ParameterServerUnavailable as exc:
            log.warning("%s", exc)

    def leave(self, signum: int = 0) -> None:
        """A worker is done (or stopped on ``signum``): the ps tasks need not wait for it."""
        client = self._client()
        try:
            client.each(ps_server.remote_leave, client.task, signum)
        except ParameterServerUnavailable:
            pass


class ParameterServerStrategy(Strategy):
    """Variables on ps tasks, training on the chief and workers.

    Args:
        cluster_resolver: the cluster (chief, worker, ps tasks) and this task's place in it;
            default ``TFConfigClusterResolver`` when ``TF_CONFIG`` is set. A cluster spec
            without a task type or id is a ``ValueError``.
        variable_partitioner: splits large variables along dim 0 (``FixedShardsPartitioner``,
            ``MinSizePartitioner``, ``MaxSizePartitioner``); None keeps every variable whole.
        num_gpus_per_worker: 0 (default): each task computes on the CPU; 1: on its GPU. Without a
            cluster, the number of local replica threads (0: one, on the CPU), on ``device``'s type.
        mode: ``"async"`` (default) or ``"sync"``.
        global_step_rule: ``"every_worker"`` (default, the seed's): the first replica of every
            training task advances the global step at each of its pushes (async: 6 after 3 steps
            of 2 tasks; sync: one per applied step, 3). ``"chief"``: only the chief's pushes
            advance it, so that it counts the chief's steps (what dlaunch's ``trainer.steps`` is).
        reduce_over: ``"tasks"`` (default): ``reduce`` combines every training task's values,
            as ``num_replicas_in_sync`` counts them; every task must call it. ``"this_task"``:
            this task's values only, for tasks that do not step together (dlaunch's runtime, whose
            workers never meet the chief in ``reduce``; in sync mode the tasks share their logged
            metrics through ps 0 instead: ``logged_metrics``).
        rpc_timeout_s: a ps that does not answer in this time is reported unavailable.
        sync_timeout_s: sync mode: how long a push may wait for the other tasks' gradients of the step.
        device: the task's compute device (default ``cuda:0`` with ``num_gpus_per_worker=1``, else
            ``cpu:0``); without a cluster its type picks the local replicas' devices.

    The chief initializes the variables: built outside ``scope()`` (real values),
    ``prepare`` sends them to the ps tasks. Under dlaunch the ps tasks build them
    from the recipe themselves, so no task ever holds a whole partitioned table.

    ``reduce`` combines every training task's values, as ``num_replicas_in_sync``
    counts them (the tasks meet at ps 0; every task must call it). With no cluster
    (no resolver, no ``TF_CONFIG``) the strategy falls back to local training, with a
    warning: variables on the CPU (or the only GPU), compute replicated on
    ``num_gpus_per_worker`` GPUs (``device="cpu"``: CPU replica threads), as
    ``CentralStorageStrategy``; the global step counts the applied steps::

        strategy = ParameterServerStrategy()            # one local replica on the CPU
        strategy.num_replicas_in_sync                   # 1
        ParameterServerStrategy(num_gpus_per_worker=2, device="cpu").num_replicas_in_sync   # 2
    """

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Partitioner | None = None, *,
                 num_gpus_per_worker: int = 0, mode: str = "async", global_step_rule: str = "every_worker",
                 reduce_over: str = "tasks",
                 rpc_timeout_s: float = 60.0, ready_timeout_s: float = 300.0, device: str | None = None,
                 open_on_prepare: bool = True, sync_timeout_s: float = 300.0):
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
        if reduce_over not in ("tasks", "this_task"):
            raise ValueError(f"reduce_over must be 'tasks' or 'this_task', got {reduce_over!r}")
        if global_step_rule not in ("every_worker", "chief"):
            raise ValueError(f"global_step_rule must be 'every_worker' or 'chief', got {global_step_rule!r}")
        if isinstance(cluster_resolver, int) and not isinstance(cluster_resolver, bool):
            raise TypeError(f"ParameterServerStrategy({cluster_resolver}): the first argument is a cluster resolver, as in "
                            f"TF 2; TF 1's contrib strategy took num_gpus_per_worker there: pass "
                            f"num_gpus_per_worker={cluster_resolver} by keyword")
        self._is_chief = True
        resolver = cluster_resolver if cluster_resolver is not None else (TFConfigClusterResolver() if tf_config() else None)
        if resolver is None or not resolver.cluster_spec():
            self._start_local(int(num_gpus_per_worker), device)
            return
        if num_gpus_per_worker > 1:
            raise ValueError(f"num_gpus_per_worker={num_gpus_per_worker}: a training task runs one replica here; "
                             "start one task per GPU (cluster.workers) instead")
        device = device or ("cuda:0" if num_gpus_per_worker == 1 else "cpu:0")
        validate_task(resolver)
        cluster = resolver.cluster_spec()
        if "ps" not in cluster.jobs:
            raise ValueError(f"the cluster {cluster.as_dict()} has no ps job: ParameterServerStrategy keeps variables on ps tasks")
        if resolver.task_type == "ps":
            raise ValueError("a ps task serves variables and trains nothing: run launcher.distribute.Server(cluster, 'ps', i).join()")
        training = [(job, i) for job in TRAINING_JOBS if job in cluster.jobs for i in cluster.task_indices(job)]
        me = (resolver.task_type, int(resolver.task_id))
        if me not in training:
            raise ValueError(f"task {me[0]}:{me[1]} is not a training task of {cluster.as_dict()}")
        ps_server.Server(cluster, me[0], me[1], start=not trpc.api._is_current_rpc_agent_set(), rpc_timeout_s=rpc_timeout_s)
        args = {
            "task": f"{me[0]}:{me[1]}", "num_ps": cluster.num_tasks("ps"), "partitioner": variable_partitioner, "mode": mode,
            "rpc_timeout_s": rpc_timeout_s, "ready_timeout_s": ready_timeout_s, "training_tasks": len(training),
            "open_on_prepare": open_on_prepare, "sync_timeout_s": sync_timeout_s, "global_step_rule": global_step_rule,
            "reduce_over": reduce_over,
        }
        super().__init__(_PSExtended(device, training.index(me), len(training), args), cluster_resolver=resolver)
        self._is_chief = me[0] == "chief"

    def _start_local(self, num_gpus: int, device: str | None) -> None:
        """No cluster: the seed's local training (``launcher/strategies/impl/ps_local.py``)."""
        devices, parameter_device = ps_local.local_devices(num_gpus, device)
        warnings.warn(f"ParameterServerStrategy without a cluster (no cluster_resolver, no TF_CONFIG): local training "
                      f"on {devices}, variables on {parameter_device}", UserWarning, stacklevel=3)
        super().__init__(ps_local.LocalPSExtended(devices, parameter_device))

    @property
    def is_chief(self) -> bool:
        return self._is_chief

    def make_dataset_iterator(self, dataset: Iterable) -> InputIterator:
        """Deprecated (TF1). As the seed's: ``dataset`` is batched by the per-replica batch size, and each replica
        dequeues whole elements, in turn over every training task's replicas (replica ``r`` of ``R`` takes element
        ``k*R + r`` at step ``k``); ``experimental_distribute_dataset`` would split each element as a global batch."""
        warnings.warn("make_dataset_iterator is TF1's: iterate distribute_datasets_from_function(dataset_fn)",
                      DeprecationWarning, stacklevel=2)
        return InputIterator(self.distribute_datasets_from_function(functools.partial(_ReplicasTurns, dataset)))

    @property
    def global_step(self) -> int:
        """The global step as last heard from ps 0; in local training, the steps applied."""
        client = getattr(self._extended, "client", None)
        return client.global_step if client else getattr(self._extended, "global_step", 0)

    @property
    def finished(self) -> bool:
        """Whether the chief has ended the job (heard at the last push)."""
        client = getattr(self._extended, "client", None)
        return bool(client and client.finished)


class _ReplicasTurns:
    """The elements of ``dataset`` that pipeline ``ctx.input_pipeline_id``'s replicas dequeue, in order: its local
    replicas take ``L`` consecutive elements in turn with the other pipelines' (``L`` replicas each). Every task
    reads the whole dataset (each keeps its turns): a ``FileDataset`` is not sharded by files, and a shuffling
    ``DataLoader`` must draw the same order on every task. Each ``iter()`` starts over (``initialize()``)."""

    def __init__(self, dataset: Iterable, ctx: InputContext):
        self.dataset, self.ctx = dataset, ctx

    def __iter__(self) -> Iterator[Any]:
        ctx = self.ctx
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return (element for i, element in enumerate(self.dataset)
                if (i // local) % ctx.num_input_pipelines == ctx.input_pipeline_id)


def from_spec(spec: Any, runtime: Runtime) -> ParameterServerStrategy:
    """This task's strategy under dlaunch: the ps tasks build the variables, the chief opens them after a resume."""
    cluster = runtime.run_spec.cluster
    task_type, index = runtime.task
    resolver = SimpleClusterResolver(ClusterSpec(cluster_def(cluster)), task_type=task_type, task_id=index)
    device = task_device(resolver.cluster_spec(), (task_type, index), runtime.device_type)
    return ParameterServerStrategy(
        resolver, spec.partitioner.build(cluster.ps), mode=spec.mode, rpc_timeout_s=spec.rpc_timeout_s,
        ready_timeout_s=runtime.run_spec.launch.rdzv_timeout_s + 300, device=device, open_on_prepare=False,
        global_step_rule="chief",  # trainer.steps counts the chief's steps; workers stop when it has made them
        reduce_over="this_task",  # workers do not stop to meet the chief; sync mode shares logged metrics (logged_metrics)
        sync_timeout_s=runtime.run_spec.launch.collective_timeout_s,
    )


def task_device(cluster: ClusterSpec, task: tuple[str, int], device_type: str) -> str:
    """A training task's device: on CUDA, a GPU of its own among the training tasks of its host (they share GPUs
    round-robin only where there are more tasks than GPUs); the ps tasks keep variables on the CPU."""
    if device_type != "cuda" or task[0] not in TRAINING_JOBS:
        return "cpu:0"
    training = [(job, i) for job in TRAINING_JOBS if job in cluster.jobs for i in cluster.task_indices(job)]
    return f"cuda:{cluster.index_on_host(task, training) % max(1, torch.cuda.device_count())}"
