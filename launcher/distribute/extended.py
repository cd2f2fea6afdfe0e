"""``StrategyExtended``: the machinery behind every strategy's public methods.

A strategy is a list of local replica devices plus the process level (one process, or a torch.distributed
group). Everything here is written once against those two levels; strategies differ in how they place devices
and ``prepare`` a model (DDP, replica copies, a plain move). Values are combined by ``cross_device_ops.py``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from launcher.distribute import devices as devlib
from launcher.distribute import cross_device_ops as cdo
from launcher.distribute.collectives import ReplicaThreads, SingleProcess, ThreadRendezvous, device_guard
from launcher.distribute.context import ReplicaContext, _current_frame, _enter, _Frame, _state
from launcher.distribute.placement import Placement
from launcher.distribute.precision import inherited_autocast
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.replicated import one_optimizer_per_replica
from launcher.distribute.values import PerReplica, contains_per_replica, map_structure, regroup, select_replica

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy


class StrategyExtended:
    """Additional APIs for algorithms that need to be distribution-aware."""

    # True in script mode, whose loss the script weights itself: a batch that splits unevenly is then said (rank 0, once)
    warn_uneven_shares = False
    collective_forward = False  # True where a model's forward runs collectives (split layers): every rank evaluates
    places_itself = False  # _prepare places the parameters itself, a piece at a time (FSDP2): prepare() moves none first
    plain_values_per_process = True  # reduce combines a process's plain tensors over the processes, as TF's multi-worker

    def __init__(
        self, devices: Sequence[str], collectives: Any = None, parameter_devices: Sequence[str] | None = None,
        cross_device_ops: cdo.CrossDeviceOps | None = None,
    ):
        if not devices:
            raise ValueError("a strategy needs at least one device")
        self._device_names = tuple(devlib.canonical_name(d) for d in devices)
        if len(set(self._device_names)) != len(self._device_names):
            raise ValueError(f"devices must be distinct, got {list(devices)}")
        self._devices = [devlib.to_torch(d) for d in self._device_names]
        self._parameter_device_names = tuple(devlib.canonical_name(d) for d in (parameter_devices or self._device_names))
        devlib.check_present([*self._device_names, *self._parameter_device_names])
        self._proc = collectives or SingleProcess()
        self._cross_device_ops = cdo.resolve(cross_device_ops)
        self._num_local = len(self._devices)
        self._replica_offset = self._proc.rank * self._num_local
        self._rendezvous = ThreadRendezvous(self._num_local) if self._num_local > 1 else None
        self._threads: ReplicaThreads | None = None
        self._created: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> parameter
        self._container: "Strategy | None" = None

    # ----- hooks for a strategy that keeps its variables itself (parameter_server: on its ps tasks) -----
    def open(self, step: int) -> None:
        """The variables are loaded (or new) at ``step``: processes that wait for them may start. Default: none wait."""

    def own_loop(self) -> Any:
        """A training loop of this strategy's that replaces dlaunch's in this process, or None (the default).

        Called as ``loop(spec, strategy, replica_step, stream)``; a parameter-server worker's steps
        until the chief is done, with no checkpoints, evaluation or summary of its own.
        """
        return None

    def finish(self) -> None:
        """Training ended here (completed, or stopped after its save): processes serving it may end. Default: none."""

    def logged_metrics(self, step: int, value: torch.Tensor) -> torch.Tensor:
        """The metrics logged for ``step`` from this process's reduced ``value``: those (the default: that reduce was
        over every replica); a parameter-server sync job's tasks share theirs, and the chief logs their mean."""
        return value

    def stop_requested(self) -> int:
        """A stop signal another process of the job stopped on, that this one must stop on too (0: none, the
        default; a parameter-server chief's sync job, whose worker stopped)."""
        return 0

    def save_checkpoint(self, model: Any, path: Any, progress: tuple[int, int, int]) -> bool:
        """Write ``model``'s variables into ``path`` where this strategy keeps them; False: dlaunch saves them (DCP)."""
        return False

    def load_checkpoint(self, model: Any, path: Any) -> tuple[int, int, int] | None:
        """Read them back and return the saved (step, epoch, batch offset); None: dlaunch loads them (DCP)."""
        return None

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes the files every process would write the same (metrics, samples, a log): rank 0
        alone (Accelerate's ``is_main_process``, Fabric's ``is_global_zero``); not for ``ScriptCheckpoints``, whose
        save every rank calls. The job's rank: under ``mesh`` the processes of one replica share a replica rank."""
        return not dist.is_initialized() or dist.get_rank() == 0

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this process runs replicas on."""
        return self._device_names

    @property
    def device_type(self) -> str:
        """The type of device this process computes on (``cpu``, ``cuda``): what autocast and GradScaler take. It is
        the strategy's own, which may differ from the cluster's (``strategy.device=cpu:0`` on a GPU machine)."""
        return self._devices[0].type

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices that hold the parameters."""
        return self._parameter_device_names

    def variable_created_in_scope(self, v: torch.Tensor) -> bool:
        """True if parameter ``v`` was registered to a module inside this strategy's ``scope()``."""
        return self._created.get(id(v)) is v

    def colocate_vars_with(self, colocate_with_variable: torch.Tensor) -> contextlib.AbstractContextManager:
        """Scope whose new parameters and buffers go where ``colocate_with_variable`` is (device; ps task)."""
        return Placement(colocate_with_variable.device, colocate_with=colocate_with_variable)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._proc.world_size * self._num_local

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        strategy = self._container
        frame = _current_frame()
        if frame is not None and frame.strategy is not strategy and frame.strategy._is_user_strategy:
            raise ValueError(
                f"Mixing different strategies: {type(strategy).__name__} scope entered inside "
                f"{type(frame.strategy).__name__} scope"
            )
        hook = torch.nn.modules.module.register_module_parameter_registration_hook(self._record)
        try:
            with _enter(strategy, None), Placement(devlib.to_torch(self._parameter_device_names[0])):
                yield
        finally:
            hook.remove()

    def _record(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        # torch's hook is process-wide; only this thread's scope counts.
        frame = _current_frame()
        if param is not None and frame is not None and frame.strategy is self._container:
            self._created[id(param)] = param

    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        frame = _current_frame()
        if frame is not None and frame.replica_context is not None:
            raise RuntimeError("strategy.run() was called inside strategy.run(); call it from cross-replica context")

        frames, guards = self._replica_frames()
        if self._num_local > 1:  # replica 0 runs in the caller's autocast and grad mode: the other threads too
            guards = self._in_callers_modes(guards)

        def call(local_id: int) -> Any:
            # The replica's frame on its own thread's stack (what ``_enter`` does, without the objects).
            stack = _state.stack
            stack.append(frames[local_id])
            try:
                mine = select_replica(local_id, args) if args else args
                my_kwargs = select_replica(local_id, kwargs) if kwargs else kwargs
                guard = guards[local_id]
                if guard is None:
                    return fn(*mine, **my_kwargs)
                with guard():
                    return fn(*mine, **my_kwargs)
            finally:
                stack.pop()

        if self._num_local == 1:
            return call(0) if self.num_replicas_in_sync == 1 else regroup([call(0)])
        with one_optimizer_per_replica(self._container):  # a model not prepared, stepped on every replica thread
            return regroup(self._replica_threads().run(call))

    def _replica_frames(self) -> tuple[list[_Frame], list[Any]]:
        """Per local replica, made once: its context frame, and its device guard (None on CPU)."""
        if self.__dict__.get("_frames") is None:
            strategy = self._container
            self._frames = (
                [_Frame(strategy, ReplicaContext(strategy, self._replica_offset + i, i)) for i in range(self._num_local)],
                [None if d.type == "cpu" else functools.partial(device_guard, d) for d in self._devices],
            )
        return self._frames

    def _in_callers_modes(self, guards: list[Any]) -> list[Any]:
        """The replica threads' guards, with the autocast the calling thread is in, its ``torch.no_grad()`` and its
        ``torch.inference_mode()`` (all are per thread), as torch's ``parallel_apply`` carries the first two."""
        device_type = self.device_type
        dtype, grad = inherited_autocast(device_type), torch.is_grad_enabled()
        inference = torch.is_inference_mode_enabled()
        if dtype is None and grad and not inference:
            return guards
        modes = (device_type, dtype, grad, inference)
        return [guards[0], *(functools.partial(_guarded_modes, g, *modes) for g in guards[1:])]

    def _replica_threads(self) -> ReplicaThreads:
        if self._threads is None:
            self._threads = ReplicaThreads(self._num_local, self._rendezvous)
        return self._threads

    def _reduce(self, reduce_op: ReduceOp, value: Any, axis: int | None) -> Any:
        if not contains_per_replica(value):
            if axis is not None or not (self._proc.world_size > 1 and self._num_local == 1 and self.plain_values_per_process):
                return map_structure(lambda t: self._reduce_plain(reduce_op, t, axis), value)
            value = map_structure(lambda t: PerReplica([t]) if isinstance(t, torch.Tensor) else t, value)
        return map_structure(lambda leaf: self._reduce_leaf(reduce_op, leaf, axis), value)

    def _reduce_plain(self, reduce_op: ReduceOp, value: Any, axis: int | None) -> Any:
        """A value that is not per-replica is already the same everywhere (or already reduced)."""
        if axis is None:
            if reduce_op is ReduceOp.SUM and self.num_replicas_in_sync > 1:
                raise ValueError(
                    f"A non-DistributedValues value {value!r} cannot be reduced with the given "
                    f"reduce op {reduce_op}."
                )
            return value
        t = torch.as_tensor(value)
        total = t.sum(dim=axis)
        return total if reduce_op is ReduceOp.SUM else total / t.shape[axis]

    def _reduce_leaf(self, reduce_op: ReduceOp, leaf: Any, axis: int | None) -> torch.Tensor:
        if not isinstance(leaf, PerReplica):
            return self._reduce_plain(reduce_op, leaf, axis)
        parts = [torch.as_tensor(v) for v in leaf.values]
        if axis is None:
            self._check_same_shapes(parts)
            count = None  # known: the number of replicas in sync
        else:
            count = sum(p.shape[axis] for p in parts)
            parts = [p.sum(dim=axis) for p in parts]
        total = self._cross_device_ops._reduce(ReduceOp.SUM, PerReplica(parts), None, self._proc)
        if reduce_op is ReduceOp.SUM:
            return total
        owned = self._proc.world_size > 1  # the process step's own buffer: divided in place
        if count is None:
            return cdo.divide_new(total, self.num_replicas_in_sync, owned)
        return cdo.divide_new(total, self._proc.all_reduce_count(count), owned)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """Combine ``value`` across replicas (SUM or MEAN) and place the result on ``destinations``.

        Uses the strategy's cross-device ops. ``destinations`` is a device name,
        a tensor (its device), a list of devices or a ``PerReplica`` (one result
        per component, as a ``PerReplica``), or None. A value that is not
        per-replica is taken as already reduced, as by ``Strategy.reduce``::

            v = PerReplica([torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])])
            strategy.extended.reduce_to(ReduceOp.SUM, v, "cpu:0")   # tensor([ 4,  6,  8, 10])
        """
        return self.batch_reduce_to(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list:
        """``reduce_to`` for several ``(value, destinations)`` pairs; ops with ``num_packs``
        reduce them together in that many buffers per dtype."""
        op = ReduceOp.from_any(reduce_op)
        pairs = list(value_destination_pairs)
        out: list[Any] = [None] * len(pairs)
        distributed = [i for i, (value, _) in enumerate(pairs) if isinstance(value, PerReplica)]
        for i, (value, destinations) in enumerate(pairs):
            if isinstance(value, PerReplica):
                self._check_same_shapes([torch.as_tensor(v) for v in value.values])
            else:
                out[i] = cdo.place(torch.as_tensor(self._reduce_plain(op, value, None)), destinations)
        reduced = self._cross_device_ops._batch_reduce(op, [pairs[i] for i in distributed], self._proc)
        for i, result in zip(distributed, reduced):
            out[i] = result
        return out

    def _check_same_shapes(self, parts: list[torch.Tensor]) -> None:
        _check_same_shapes(parts)
        if self._proc.world_size > 1:
            self._cross_device_ops._check_same_shape(parts[0], self._proc)

    def _gather(self, value: Any, axis: int) -> Any:
        def leaf_gather(leaf: Any) -> torch.Tensor:
            parts = leaf.values if isinstance(leaf, PerReplica) else (leaf,) * self._num_local
            tensors = [torch.as_tensor(p) for p in parts]
            home = tensors[0].device
            local = torch.cat([t.to(home) for t in tensors], dim=axis)
            return self._proc.all_gather_cat(local, axis)

        if self.num_replicas_in_sync == 1 and not contains_per_replica(value):
            return value
        return map_structure(leaf_gather, value)

    def _local_results(self, value: Any) -> tuple:
        if isinstance(value, PerReplica):
            return value.values
        if contains_per_replica(value):
            return tuple(select_replica(i, value) for i in range(self._num_local))
        return (value,)

    def _distribute_values(self, value_fn: Callable[[Any], Any]) -> Any:
        from launcher.distribute.input_context import ValueContext

        values = [
            value_fn(ValueContext(self._replica_offset + i, self.num_replicas_in_sync))
            for i in range(self._num_local)
        ]
        return values[0] if self.num_replicas_in_sync == 1 else PerReplica(values)

    def _replica_all_reduce(self, local_id: int, reduce_op: ReduceOp, value: Any) -> Any:
        def finish(total: torch.Tensor) -> torch.Tensor:
            return total if reduce_op is ReduceOp.SUM else total / self.num_replicas_in_sync

        ops = self._cross_device_ops
        if self._num_local == 1:
            return map_structure(lambda t: finish(ops._process_sum(torch.as_tensor(t), self._proc)), value)
        contributions = self._rendezvous.exchange(local_id, value)
        local_total = map_structure(lambda *parts: ops._local_sum(parts), *contributions)
        total = self._leader_then_share(local_id, lambda: map_structure(lambda t: ops._process_sum(t, self._proc), local_total))
        device = self._devices[local_id]
        return map_structure(lambda t: finish(t).to(device), total)

    def _replica_all_gather(self, local_id: int, value: Any, axis: int) -> Any:
        if self._num_local == 1:
            return map_structure(lambda t: self._proc.all_gather_cat(torch.as_tensor(t), axis), value)
        contributions = self._rendezvous.exchange(local_id, value)
        local = map_structure(lambda *ts: torch.cat([t.to(ts[0].device) for t in ts], dim=axis), *contributions)
        gathered = self._leader_then_share(local_id, lambda: map_structure(lambda t: self._proc.all_gather_cat(t, axis), local))
        device = self._devices[local_id]
        return map_structure(lambda t: t.to(device), gathered)

    def _leader_then_share(self, local_id: int, leader_fn: Callable[[], Any]) -> Any:
        """Local replica 0 does the process-level step; every local replica gets its result."""
        if self._proc.world_size == 1:
            return leader_fn()
        result = leader_fn() if local_id == 0 else None
        return self._rendezvous.exchange(local_id, result)[0]

    def _merge_call(self, local_id: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        strategy = self._container
        if self._num_local == 1:
            if self.num_replicas_in_sync > 1:
                args, kwargs = regroup([args]), regroup([kwargs])
            with _enter(strategy, None):
                return merge_fn(strategy, *args, **kwargs)
        everyone = self._rendezvous.exchange(local_id, (args, kwargs))
        result = None
        if local_id == 0:
            # If merge_fn raises, replica 0 raises it at once; the others are released by the
            # aborted barrier and the original exception is what the caller sees.
            with _enter(strategy, None):
                result = merge_fn(strategy, *regroup([a for a, _ in everyone]), **regroup([k for _, k in everyone]))
        return self._rendezvous.exchange(local_id, result)[0]

    def _prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        return module, optimizer

    def _input_devices(self) -> list[torch.device]:
        return list(self._devices)

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Deprecated (TF1): run ``fn`` on each replica, as ``strategy.run`` does."""
        import warnings

        warnings.warn("extended.call_for_each_replica is TF1's: use strategy.run", DeprecationWarning, stacklevel=2)
        return self._container.run(fn, tuple(args), kwargs)

    @property
    def _gradients_averaged_over(self) -> int:
        """How many replicas' gradients ``optimizer.step()`` averages (DDP's mean): all of them."""
        return self.num_replicas_in_sync

    @property
    def _reads_input(self) -> bool:
        """Whether this process builds and reads its replicas' input (else ``_share_input`` brings it)."""
        return True

    def _share_input(self, steps: Iterator[list[Any]]) -> Iterator[list[Any]]:
        """The input steps of this process's replicas, from whichever process reads them."""
        return steps

    def _input_agreement(self) -> Callable[[int], int] | None:
        """How processes reading datasets of their own add up each step's rows (none left anywhere: the end)."""
        return self._proc.sum_rows


def _check_same_shapes(parts: list[torch.Tensor]) -> None:
    shapes = [tuple(p.shape) for p in parts]  # replica by replica
    if len(set(shapes)) > 1:
        raise ValueError(
            f"per-replica values have different shapes {shapes}; pass axis= to reduce "
            "along the batch dimension (for example with a last partial batch)"
        )


@contextlib.contextmanager
def _guarded_modes(guard: Any, device_type: str, dtype: torch.dtype | None, grad: bool, inference: bool) -> Iterator[None]:
    """A replica thread's device guard (if any), and inside it the caller's autocast, grad and inference modes."""
    with guard() if guard is not None else contextlib.nullcontext(), torch.inference_mode(inference), \
            torch.set_grad_enabled(grad), \
            torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        yield
