"""``CentralStorageStrategy``: one machine; parameters stored once, compute replicated.

As ``tf.distribute.experimental.CentralStorageStrategy``: the parameters and the
optimizer state live once, on the parameter device (the CPU, or the only GPU).
Every compute device runs a replica of the step on the current values, on the
replica threads ``MirroredStrategy`` uses in one process. When the replicas'
backward passes end, their gradients are summed onto the parameter device
(``ReductionToOneDevice``) and averaged; ``optimizer.step()`` then applies the
update once, with the one optimizer. In torch terms: one module and one
optimizer, a forward and backward per device on threads, and a reduction to one
device instead of an all-reduce.

On the parameter device's own memory (``cpu:0`` and ``cpu:1`` are both the CPU)
a replica reads the central parameters in place: it holds leaf tensors that
share their storage, so no copy exists. On another device a replica reads a
copy made at each forward (TF's reads of a variable from a compute device).

Example::

    strategy = CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"], parameter_device="cpu:0")
    with strategy.scope():
        model = torch.nn.Linear(4, 1)                    # created on the parameter device
        optimizer = torch.optim.Adam(model.parameters())
        model, optimizer = strategy.prepare(model, optimizer)
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from launcher.distribute import cross_device_ops as cdo
from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ThreadRendezvous
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.replicated import DelegatingOptimizer, ReplicaParameters, _local_id, check_own_parameters
from launcher.distribute.strategy import Strategy
from launcher.strategies import Runtime


class CentralModule(ReplicaParameters):
    """The one module (``.module``, on the parameter device) and a parameter-less view per replica.

    A view is a structural copy whose parameters are leaves reading the central
    values; its buffers are its own (replica 0's are the central ones when it is on
    the parameter device's memory) and follow replica 0's after each backward, as
    DDP broadcasts them.
    """

    def __init__(
        self, module: torch.nn.Module, compute_devices: Sequence[torch.device], parameter_device: torch.device,
        strategy: Any, rendezvous: ThreadRendezvous | None, cross_device_ops: cdo.CrossDeviceOps,
    ):
        super().__init__()
        self.module = module.to(parameter_device)
        views = [_view(self.module, d, share_buffers=(i == 0 and d == parameter_device)) for i, d in enumerate(compute_devices)]
        object.__setattr__(self, "replicas", views)  # not submodules: parameters() and state_dict() are the central ones
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_rendezvous", rendezvous)
        object.__setattr__(self, "_cross_device_ops", cross_device_ops)
        object.__setattr__(self, "_pending", [False] * len(views))
        object.__setattr__(self, "_in_run", [False] * len(views))
        for local, view in enumerate(views):
            for q in view.parameters():
                if q.requires_grad:
                    q.register_post_accumulate_grad_hook(lambda _q, local=local: self._gradient_ready(local))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        local = _local_id(self._strategy)
        if local is None:  # cross-replica context (evaluation, a loop of one's own): the central module
            return self.module(*args, **kwargs)
        self._read_parameters(local)
        self._in_run[local] = True
        return self.replicas[local](*args, **kwargs)

    def _read_parameters(self, local: int) -> None:
        with torch.no_grad():
            for p, q in zip(self.module.parameters(), self.replicas[local].parameters()):
                if p.device == q.device:
                    q.data = p.data  # the same storage: no copy
                else:
                    q.data = p.detach().to(q.device, non_blocking=True)

    def _gradient_ready(self, local: int) -> None:
        """Once per backward pass, when the whole pass has finished (as ``MirroredModule``)."""
        if self._in_run[local] and not self._pending[local]:
            self._pending[local] = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._sync(local))

    def _sync(self, local: int) -> None:
        """Average the replicas' gradients: summed on the parameter device, then given back to each view."""
        self._pending[local] = self._in_run[local] = False
        if self._rendezvous is None:
            return
        grads = [q.grad for q in self.replicas[local].parameters()]
        self._rendezvous.all_reduce_mean_(local, grads, self._cross_device_ops, meanwhile=lambda: self._copy_buffers(local))

    def _copy_buffers(self, local: int) -> None:
        # Every replica's forward is over, so replica 0's buffers (BatchNorm statistics) are stable.
        with torch.no_grad():
            first = list(self.replicas[0].buffers())
            targets = self.module.buffers() if local == 0 else self.replicas[local].buffers()
            for mine, primary in zip(targets, first):
                if mine is not primary:
                    mine.copy_(primary)

    def _take_gradients(self) -> None:
        """Give the central parameters replica 0's averaged gradients (the same tensors on the same memory)."""
        for p, q in zip(self.module.parameters(), self.replicas[0].parameters()):
            p.grad = None if q.grad is None else q.grad.to(p.device)

    def zero_view_grads(self, local: int | None) -> None:
        for view in self.replicas if local is None else [self.replicas[local]]:
            for q in view.parameters():
                q.grad = None

    def resync(self) -> None:
        """After a failed step or a loaded checkpoint: no gradient pending, buffers from the central module."""
        self._pending[:] = [False] * len(self.replicas)
        self._in_run[:] = [False] * len(self.replicas)
        self.zero_view_grads(None)
        with torch.no_grad():
            for view in self.replicas:
                for mine, central in zip(view.buffers(), self.module.buffers()):
                    if mine is not central:
                        mine.copy_(central)

    def train(self, mode: bool = True) -> "CentralModule":
        super().train(mode)
        for view in self.replicas:
            view.train(mode)
        return self


def _view(module: torch.nn.Module, device: torch.device, share_buffers: bool) -> torch.nn.Module:
    """A copy of ``module``'s structure for one compute device, without copying its parameters."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        value = p.detach() if p.device == device else torch.empty(0, dtype=p.dtype, device=device)
        memo[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    if share_buffers:
        for b in module.buffers():
            memo[id(b)] = b
    view = copy.deepcopy(module, memo)
    for name, b in list(view.named_buffers()):
        if b.device != device:
            owner, _, leaf = name.rpartition(".")
            view.get_submodule(owner)._buffers[leaf] = b.to(device)
    return view


class CentralOptimizer(DelegatingOptimizer):
    """The one optimizer; ``step()`` inside ``strategy.run`` updates the central parameters once.

    Every replica calls ``step()``; they meet, replica 0 applies the update with the
    averaged gradients, and none goes on before it is done. ``param_groups``,
    ``state`` and ``state_dict`` are the optimizer's own.
    """

    def __init__(self, primary: torch.optim.Optimizer, module: CentralModule):
        check_own_parameters(primary, module.module)
        super().__init__(primary)
        self._module = module

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        local = _local_id(self._module._strategy)
        if local is None:  # backward ran on the central module itself
            return self._primary.step(closure)
        return self._once(local, lambda: self._primary.step(closure))

    def _once(self, local: int, update: Callable[[], Any]) -> Any:
        rendezvous = self._module._rendezvous
        if rendezvous is not None:
            rendezvous.wait()  # every replica has its averaged gradients and has stopped reading parameters
        result = None
        if local == 0:
            self._module._take_gradients()
            result = update()
        if rendezvous is None:
            return result
        return rendezvous.exchange(local, result)[0]  # nobody reads the parameters before they are updated

    def zero_grad(self, set_to_none: bool = True) -> None:
        local = _local_id(self._module._strategy)
        self._module.zero_view_grads(local)
        if local in (None, 0):
            self._primary.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        self._primary.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"CentralOptimizer({type(self._primary).__name__}, replicas={len(self._module.replicas)})"


class _CentralExtended(StrategyExtended):
    def __init__(self, compute_devices: Sequence[str], parameter_device: str):
        ops = cdo.ReductionToOneDevice(reduce_to_device=parameter_device)
        super().__init__(compute_devices, None, parameter_devices=[parameter_device], cross_device_ops=ops)
        self._central: list[CentralModule] = []

    def _call_for_each_replica(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        except BaseException:
            for module in self._central:  # no gradient of the failed step is left pending
                module.resync()
            raise

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        parameter_device = devlib.to_torch(self._parameter_device_names[0])
        central = CentralModule(module, self._devices, parameter_device, self._container, self._rendezvous, self._cross_device_ops)
        self._central.append(central)
        return central, (None if optimizer is None else CentralOptimizer(optimizer, central))


class CentralStorageStrategy(Strategy):
    """A one-machine strategy that puts all parameters on a single device.

    Parameters and optimizer state are stored once, on ``parameter_device``;
    compute (forward and backward) is replicated across ``compute_devices``, and
    gradients are summed onto the parameter device before the one update.

    Args:
        compute_devices: replica devices, e.g. ``["GPU:0", "GPU:1"]`` or ``["cpu:0", "cpu:1"]``
            (two CPU replicas on threads). Default: every visible GPU, else the CPU.
        parameter_device: where parameters and optimizer state live. Default: the
            only compute device if there is one, else the CPU.

    With ``compute_devices=["cpu:0", "cpu:1"]`` a global batch ``[0..7]`` gives the
    replicas ``[0,1,2,3]`` and ``[4,5,6,7]``; ``reduce(SUM, v, axis=None)`` is
    ``[4,6,8,10]``, and reducing that with ``axis=0`` is ``28``.
    """

    def __init__(self, compute_devices: Sequence[str] | None = None, parameter_device: str | None = None):
        compute = [devlib.canonical_name(d) for d in (compute_devices or devlib.default_local_devices())]
        if parameter_device is None:
            parameter_device = compute[0] if len(compute) == 1 else "cpu:0"
        super().__init__(_CentralExtended(compute, devlib.canonical_name(parameter_device)))


def from_spec(spec: Any, runtime: Runtime) -> CentralStorageStrategy:
    """Compute devices as the spec lists them; by default one of the cluster's device type."""
    default = "cuda:0" if runtime.device_type == "cuda" else "cpu:0"
    return CentralStorageStrategy(spec.compute_devices or [default], spec.parameter_device)
