"""``Strategy``: a state & compute distribution policy on a list of devices.

The same custom training loop runs under every strategy::

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = strategy.prepare(model, optimizer)

    def replica_fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()          # gradients are averaged over replicas first
        optimizer.zero_grad()
        return loss

    for x, y in strategy.experimental_distribute_dataset(loader):
        per_replica = strategy.run(replica_fn, args=(x, y))
        mean_loss = strategy.reduce(ReduceOp.MEAN, per_replica, axis=None)
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from launcher.distribute import activation_checkpointing, context, gradient_sync, placement, precision, prepare_checks
from launcher.distribute.grad_norm import averaged_grad_norm
from launcher.distribute.extended import StrategyExtended
from launcher.distribute import run_options
from launcher.distribute.input_context import InputOptions, InputReplicationMode
from launcher.distribute.input_iterator import InputIterator
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.run_options import RunOptions
from launcher.distribute.values import PerReplica, map_structure

log = logging.getLogger("dlaunch")


class Strategy:
    """Base of every strategy: the tf.distribute.Strategy API over a ``StrategyExtended``."""

    _is_user_strategy = True
    _precision = "fp32"  # trainer.precision where dlaunch runs the script; the ``precision`` setter elsewhere
    _autocast_used = False  # whether the script entered autocast() (it is told if it did not)
    _prepared = False  # whether prepare() distributed a model (a script under fsdp or mesh is told if not)
    _scaler: torch.amp.GradScaler | None = None  # grad_scaler()'s, made at its first call
    #: module class names whose forward ``prepare()`` makes recompute in backward (``trainer.activation_checkpointing``
    #: where dlaunch runs the script; set it before ``prepare()`` elsewhere)
    activation_checkpointing: Sequence[str] = ()

    def __init__(self, extended: StrategyExtended, cluster_resolver: Any = None):
        self._extended = extended
        self._module_types: set[str] = set()  # the classes of the models prepare() was given
        self._cluster_resolver = cluster_resolver
        extended._container = self

    @property
    def extended(self) -> StrategyExtended:
        """``StrategyExtended`` with additional methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which gradients are aggregated (all workers)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of a multi-worker strategy; None for single-worker strategies."""
        return self._cluster_resolver

    def scope(self) -> contextlib.AbstractContextManager:
        """Make this strategy current and enter its cross-replica context.

        Modules built inside get their parameters on the strategy's parameter
        device, and ``extended.variable_created_in_scope`` recognises them.
        """
        return self._extended._scope()

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: RunOptions | None = None) -> Any:
        """Run ``fn`` on each replica with the given arguments.

        ``PerReplica`` arguments are unwrapped to each replica's component; other
        arguments are passed to every replica as they are. Returns per-replica
        values (plain values when there is a single replica in sync). ``options``:
        a ``RunOptions`` (checked; its defaults are what eager torch does).
        """
        run_options.check(options)
        return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    def experimental_run_v2(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                            options: RunOptions | None = None) -> Any:
        """Deprecated alias of ``run`` (TF 2.0-2.1's name); warns, then runs."""
        warnings.warn("experimental_run_v2 is deprecated: use strategy.run", DeprecationWarning, stacklevel=2)
        return self.run(fn, args, kwargs, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any, session: Any = None) -> Any:
        """Deprecated: a dataset of the rows of ``numpy_input`` (``launcher.input.numpy_rows.NumpyRows``).

        Batch it with a ``DataLoader`` and pass that to ``experimental_distribute_dataset``.
        ``session`` is TF1 graph mode's: only None.
        """
        from launcher.input.numpy_rows import NumpyRows

        warnings.warn("experimental_make_numpy_dataset is deprecated: build a Dataset (NumpyRows, TensorDataset)",
                      DeprecationWarning, stacklevel=2)
        if session is not None:
            raise ValueError("session is TF1 graph mode's; torch runs eagerly: pass session=None")
        return NumpyRows(numpy_input)

    # ----- TF1 (``tf.compat.v1``) methods, deprecated there too -----
    def experimental_run(self, fn: Callable[..., Any], input_iterator: InputIterator | None = None) -> Any:
        """Deprecated (TF1): ``run(fn)`` on one ``input_iterator.get_next()`` step, or with no arguments."""
        warnings.warn("experimental_run is TF1's: use strategy.run(fn, args=(next(iterator),))", DeprecationWarning, stacklevel=2)
        return self.run(fn) if input_iterator is None else self.run(fn, args=(input_iterator.get_next(),))

    def make_dataset_iterator(self, dataset: Iterable) -> InputIterator:
        """Deprecated (TF1): an ``InputIterator`` over ``experimental_distribute_dataset(dataset)``."""
        warnings.warn("make_dataset_iterator is TF1's: iterate experimental_distribute_dataset(dataset)", DeprecationWarning, stacklevel=2)
        return InputIterator(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn: Callable[[Any], Iterable],
                               replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER) -> InputIterator:
        """Deprecated (TF1): an ``InputIterator`` over ``distribute_datasets_from_function(input_fn)``.

        As in TF1, only ``PER_WORKER`` (one ``input_fn`` call per worker) is accepted.
        """
        warnings.warn("make_input_fn_iterator is TF1's: iterate distribute_datasets_from_function(input_fn)",
                      DeprecationWarning, stacklevel=2)
        if replication_mode is not InputReplicationMode.PER_WORKER:
            raise ValueError(f"make_input_fn_iterator supports InputReplicationMode.PER_WORKER only, got {replication_mode}")
        return InputIterator(self.distribute_datasets_from_function(input_fn))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce ``value`` across replicas, and along ``axis`` within each replica.

        With a global batch ``[0..7]`` split ``[0,1,2,3]`` / ``[4,5,6,7]`` over two
        replicas, ``reduce(SUM, v, axis=None)`` is ``[4, 6, 8, 10]`` and
        ``reduce(SUM, v, axis=0)`` is ``28``. With ``axis``, ``MEAN`` divides by
        the number of elements along it over all replicas (6 for a last partial
        batch ``[0,1,2,3]`` / ``[4,5]``). A value that is not per-replica is taken
        as already reduced, and ``axis`` reduces it locally; but with ``axis=None`` in a job of several processes
        (one replica each) a plain tensor is its process's own, reduced over the processes (TF's multi-worker
        strategies; Accelerate's ``reduce``).
        """
        frame = context._current_frame()
        if frame is not None and frame.replica_context is not None:  # inside strategy.run, as TF refuses it
            raise RuntimeError("Method requires being in cross-replica context, use get_replica_context().merge_call() "
                               "(strategy.reduce inside strategy.run: return the per-replica value and reduce it after "
                               "run, or use get_replica_context().all_reduce)")
        if axis is not None:
            map_structure(lambda leaf: _check_axis(leaf, axis), value)
        return self._extended._reduce(ReduceOp.from_any(reduce_op), value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica ``value`` over all replicas along ``axis``."""
        return self._extended._gather(value, axis)

    def experimental_distribute_dataset(self, dataset: Iterable, options: InputOptions | None = None):
        """Split each global batch of ``dataset`` across the replicas.

        ``dataset`` yields global batches (a ``DataLoader``, a list of tensors,
        any iterable). Replica ``i`` gets rows ``[i*b, (i+1)*b)`` with ``b`` the
        per-replica batch size; a last partial batch of 6 over 2 replicas gives
        ``[0,1,2,3]`` / ``[4,5]``. For a ``DataLoader`` over a map-style dataset,
        each process loads only its own replicas' rows.

        A batched ``launcher.input.files.FileDataset`` is first sharded across
        worker processes by ``options.auto_shard_policy`` (FILE: worker ``i`` of
        ``n`` reads files ``i, i+n, ...``; DATA: it keeps elements ``k % n == i``;
        OFF: every worker sees every element; AUTO: FILE when files >= workers,
        else DATA). Workers with uneven FILE shards stop together at the shortest.
        """
        from launcher.input.distributed_dataset import DistributedDataset

        return DistributedDataset(dataset, self, options or InputOptions())

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable], options: InputOptions | None = None):
        """Call ``dataset_fn(InputContext)`` once per input pipeline and distribute its batches.

        The returned datasets must already be batched per replica and sharded;
        every local replica dequeues one batch per step.
        """
        from launcher.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self, options or InputOptions())

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable],
                                                       options: InputOptions | None = None):
        """The seeds' name for ``distribute_datasets_from_function`` (the same call).

        ``dataset_fn`` is called once per worker (once per replica under
        ``MeshStrategy``, whose logical devices share their replica's input)::

            def dataset_fn(ctx):
                batch = ctx.get_per_replica_batch_size(8)
                return [torch.ones(batch, 1)] * 4
            for batch in strategy.experimental_distribute_datasets_from_function(dataset_fn):
                strategy.run(replica_fn, args=(batch,))
        """
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """Build a per-replica value by calling ``value_fn(ValueContext)`` for each local replica."""
        return self._extended._distribute_values(value_fn)

    def experimental_local_results(self, value: Any) -> tuple:
        """The values of ``value`` on this process's replicas, as a tuple (``(value,)`` for a single value).

        For a parameter of a model that ``MirroredStrategy.prepare`` copied onto
        replica threads, every replica's copy (TF's mirrored components). A module
        built in ``scope()`` has one tensor per parameter until ``prepare()`` makes
        the copies; across processes each process holds its own replica's.
        """
        return self._extended._local_results(value)

    def prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Distribute a model (and its optimizer) the way this strategy trains.

        Returns ``(module, optimizer)``, or the module alone when no optimizer is
        given. Plain torch code then runs unchanged: ``loss.backward()`` and
        ``optimizer.step()`` inside ``run`` average gradients over replicas.
        """
        prepare_checks.refuse_wrapped(module, self.num_replicas_in_sync)
        prepare_checks.refuse_all_frozen(optimizer)
        prepare_checks.warn_mistyped_groups(optimizer)
        if not self._extended.places_itself:
            placement.settle(module)  # called inside scope(): the parameters go to the device first
        if self.activation_checkpointing and self._extended._num_local > 1:
            raise ValueError("activation checkpointing needs one replica per process: replica threads share the CPU's "
                             "random generator, and a recomputed forward restores its state under the other replicas")
        # before DDP or FSDP2 wrap it; a script may prepare several models, each with some of the classes
        recomputed = activation_checkpointing.apply(module, self.activation_checkpointing, strict=False)
        present = activation_checkpointing.types_in(module)
        self._module_types |= present
        if recomputed:
            log.info("activation checkpointing: %d module(s) of %s recompute their forward in backward", recomputed,
                     ", ".join(name for name in self.activation_checkpointing if name in present))
        if optimizer is not None:
            prepare_checks.align_optimizer_state(optimizer)
        module, optimizer = self._extended._prepare(module, optimizer)
        self._prepared = True
        return module if optimizer is None else (module, optimizer)

    # ----- a custom loop's precision, accumulation and clipping, as dlaunch's loop does them -----
    @property
    def precision(self) -> str:
        """``trainer.precision`` of the run (``fp32``, ``bf16-mixed``, ``fp16-mixed``). Outside dlaunch it is ``fp32``
        until set (``strategy.precision = "bf16-mixed"``), before ``grad_scaler()`` is first called."""
        return self._precision

    @precision.setter
    def precision(self, name: str) -> None:
        if name not in precision.DTYPES:
            raise ValueError(f"precision must be one of {list(precision.DTYPES)}, got {name!r}")
        if self._scaler is not None and name != self._precision:
            raise RuntimeError(f"precision is {self._precision!r} and grad_scaler() was made for it; set the "
                               f"precision before the first grad_scaler() call")
        self._precision = name

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` in the run's precision on this strategy's device; nothing under fp32. Enter it around
        the forward pass and the loss, in the function ``run`` runs or around ``run`` itself (replica threads
        enter it too)."""
        self._autocast_used = True
        with precision.autocast(self.precision, self._extended.device_type):
            yield

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16-mixed's ``torch.amp.GradScaler`` (``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
        ``scaler.update()``), the same one at every call, so its scale adapts over the steps; a disabled one, which
        passes everything through, under any other precision."""
        if self._scaler is None:
            self._scaler = precision.grad_scaler(self.precision, self._extended.device_type)
        return self._scaler

    def no_sync(self, module: torch.nn.Module, enabled: bool = True, check: bool = True) -> contextlib.AbstractContextManager:
        """Backward passes inside do not sync gradients (DDP's ``no_sync``, FSDP2's gradient sync off): the
        micro-steps of gradient accumulation, before one backward outside it (or with ``enabled=False``) syncs
        them all. An ``optimizer.step()`` whose last backward ran inside it raises ``UnsyncedStep`` rather than
        let the replicas drift apart; ``check=False``, for a script that syncs the gradients itself, does not."""
        return gradient_sync.watched(module, check) if enabled else contextlib.nullcontext()

    def clip_grad_norm_(self, module: torch.nn.Module, optimizer: Any, max_norm: float | None) -> torch.Tensor | None:
        """The total norm of ``module``'s averaged gradients, a plain tensor (split DTensor gradients count whole;
        the mesh's optimizer averages them first), after which they are scaled to at most ``max_norm``
        (None: measured only); None where no parameter has a gradient. Call it after backward and before
        ``optimizer.step()``. Under fp16-mixed it unscales them first (``grad_scaler().unscale_(optimizer)``,
        unless the script did)."""
        if self._scaler is not None and self._scaler.is_enabled():
            precision.unscale_once(self._scaler, optimizer)
        return averaged_grad_norm(module, optimizer, max_norm)

    def _unused_precision_helpers(self) -> list[str]:
        """The helpers the precision needs that the script never used: ``autocast`` (never entered) and, under
        fp16-mixed, ``grad_scaler`` (never made). dlaunch tells a script's user after its first optimizer step (else at
        its end)."""
        unused = ["autocast"] if self._precision != "fp32" and not self._autocast_used else []
        return unused + (["grad_scaler"] if self._precision == "fp16-mixed" and self._scaler is None else [])

    def _unfound_recompute(self) -> list[str]:
        """``activation_checkpointing`` names that no model given to ``prepare()`` contains (a script is told)."""
        return [name for name in self.activation_checkpointing if name not in self._module_types]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(devices={list(self._extended.worker_devices)}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _zero(lr: Any) -> bool:
    """An lr of 0: a number, or a CPU tensor (torch's state-filling step sets one). A tensor on a device is taken as
    not 0: reading it would wait for the device (and fail inside a CUDA graph's capture)."""
    if isinstance(lr, torch.Tensor):
        return lr.device.type == "cpu" and lr.numel() == 1 and float(lr) == 0.0
    return isinstance(lr, (int, float)) and lr == 0


def _check_axis(leaf: Any, axis: int) -> None:
    """``reduce(..., axis=k)`` reduces along dimension ``k`` of each replica's value: one it does not have is TF's
    ValueError, not an IndexError from within (a per-replica scalar, a loss, takes ``axis=None``)."""
    for part in leaf.values if isinstance(leaf, PerReplica) else (leaf,):
        dims = part.dim() if isinstance(part, torch.Tensor) else 0 if isinstance(part, (int, float)) else \
            getattr(part, "ndim", None)  # a numpy array or scalar
        if dims is not None and not -dims <= axis < dims:
            scalar = " (a per-replica scalar, such as a loss, is reduced with axis=None)" if dims == 0 else ""
            raise ValueError(f"Invalid reduction dimension {axis} for input with {dims} dimensions{scalar}")
