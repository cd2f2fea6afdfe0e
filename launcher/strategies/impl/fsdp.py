"""``FSDPStrategy``: sharded data parallelism through torch's FSDP2 (``fully_shard`` on a 1-D DeviceMesh).

Data parallel like ``multi_worker_mirrored`` (one process per device, each reads
its share of every global batch), but each rank keeps only ``1/N`` of every
parameter, gradient and optimizer state. A layer's parameters are all-gathered
just before its forward (and again before its backward when
``reshard_after_forward``), and its gradients are reduce-scattered, so a step
computes the same averaged gradient as DDP with a fraction of the memory.

``wrap`` names the module classes to shard one by one (each instance is its own
all-gather unit, e.g. a transformer block); the root is sharded last and holds
the rest. ``trainer.precision=bf16-mixed`` becomes FSDP's ``MixedPrecisionPolicy``
(bf16 compute, fp32 gradient reduction, fp32 sharded master weights).

Example (in a process started by dlaunch or torchrun)::

    strategy = FSDPStrategy(wrap=["TransformerEncoderLayer"])
    with strategy.scope():
        model = build_model()
        model, optimizer = strategy.prepare(model, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from launcher.distribute.activation_checkpointing import instances
from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.dtensors import whole
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.meta_scope import MetaScope
from launcher.distribute.replicated import check_own_parameters
from launcher.distribute.strategy import Strategy
from launcher.strategies import Runtime

log = logging.getLogger("dlaunch")

# Optimizer state tensors per parameter element, for the plan's memory row (torch.optim's own classes).
_STATE_PER_PARAM = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adagrad": 1, "RMSprop": 1, "Adamax": 2, "NAdam": 2, "RAdam": 2}


# ---------- memory arithmetic (the plan) ----------
def state_bytes(model: torch.nn.Module, optimizer: Any) -> tuple[int, int, int, int]:
    """(parameter bytes, gradient bytes, the bytes of the parameters the optimizer updates, its state tensors per
    such parameter) of a model built on any device, meta included. A frozen parameter (a fine-tune's) has neither
    gradient nor optimizer state."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = grads = updated = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        params += size
        grads += size if p.requires_grad else 0
        updated += size if p.requires_grad and id(p) in held else 0
    name = type(optimizer).__name__
    per = _STATE_PER_PARAM.get(name, 2)
    if name == "SGD" and not any(g.get("momentum") for g in optimizer.param_groups):
        per = 0
    return params, grads, updated, per


def memory_row(spec: Any, run_dir: Path, ways: int | None = None, how: str = "") -> str:
    """'params + grads + optimizer state per rank: X MiB = 1/N of DDP's Y MiB' for the spec's recipe.

    ``ways``: how many pieces each rank's share is (default: the replicas); ``how`` says how they are
    cut, where that is not simply FSDP over every rank (the mesh: FSDP x TP).
    """
    from launcher.distribute.meta_scope import variables_scope
    from launcher.runtime.ps_task import build_variables

    built = None
    # everything on meta (data too: nothing read or computed); where the recipe computes on its data as it builds it
    # (charlm's text into windows), the modules' tensors alone, the data real
    for scope in (lambda: torch.device("meta"), variables_scope):
        try:
            with scope(), warnings.catch_warnings():
                # a recipe that loads pretrained weights into the meta model: torch warns once per tensor (a no-op)
                warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
                built = build_variables(spec, run_dir)
            break
        except Exception as exc:  # noqa: BLE001 - the plan shows why, the run itself will say more
            failed = exc
    if built is None:
        return f"unknown: the recipe's model could not be built on the meta device ({type(failed).__name__}: {failed})"
    model, optimizer = built
    params, grads, updated, per = state_bytes(model, optimizer)
    ddp = params + grads + updated * per  # parameters, gradients, optimizer state: every rank holds all of them
    n = ways or spec.num_replicas
    frozen = f", {_mib(params - grads)} of them frozen" if grads < params else ""
    trained = "trained " if frozen else ""
    what = f"{_mib(params)} parameters{frozen}, {type(optimizer).__name__}: {per} state tensor(s) per {trained}parameter{how}"
    if n == 1:
        return f"params + grads + optimizer state: {_mib(ddp)}, nothing sharded on one process ({what})"
    return f"params + grads + optimizer state per rank: {_mib(ddp / n)} = 1/{n} of DDP's {_mib(ddp)} ({what})"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{int(b):,} bytes"


def local_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """What this rank holds now: its parameter, gradient and optimizer-state shards (measured, not computed)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return total


# ---------- the strategy ----------
class WrapError(ValueError):
    """``strategy.wrap`` names a class the model does not contain."""

    explained = True  # the message names the model's module types: dlaunch's frames add nothing


def wrapped_units(module: torch.nn.Module, wrap: Sequence[str]) -> list[torch.nn.Module]:
    """Every submodule of a class named in ``wrap``, children before parents (fully_shard's order)."""
    units = list(reversed(instances(module, wrap, "strategy.wrap", WrapError)))
    _no_weight_across_units(module, units)
    return units


def _no_weight_across_units(module: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """A parameter held by modules of two units (a tied embedding and output head, with one of them wrapped) fails
    in torch's first forward; named here, before anything is sharded, with the classes to leave out of the wrap. A
    module used at two places is one module, in one unit."""
    unit_ids = {id(u) for u in units}
    held: dict[int, dict[int, str]] = {}  # parameter -> {its holder's unit: the holder's path}
    names: dict[int, str] = {}  # unit -> its first path

    def walk(m: torch.nn.Module, path: str, unit: int) -> None:
        if id(m) in unit_ids:
            unit = id(m)
            names.setdefault(unit, path.rstrip("."))
        for pname, p in m.named_parameters(recurse=False):
            held.setdefault(id(p), {}).setdefault(unit, path + pname)
        for cname, child in m.named_children():
            walk(child, f"{path}{cname}.", unit)

    walk(module, "", id(module))
    for holders in held.values():
        if len(holders) > 1:
            by = ", ".join(f"{where} ({'unit ' + names[u] if u in names else 'the root'})" for u, where in holders.items())
            classes = sorted({type(module.get_submodule(names[u])).__name__ for u in holders if u in names})
            raise WrapError(f"strategy.wrap: one parameter is held by {by}: a tied weight in two FSDP units, which torch "
                            f"cannot shard; leave {' and '.join(classes)} out of strategy.wrap so that its holders share a unit")


def _check_optimizer(optimizer: Any, module: torch.nn.Module) -> None:
    """Before sharding: an optimizer that has stepped is refused (its state belongs to an unsharded training), and
    so is one over tensors the model does not hold."""
    if any(float(state.get("step", 1)) > 0 for state in optimizer.state.values()):  # no step count: it has stepped
        raise ValueError("FSDP shards the model in prepare(); give it an optimizer that has not stepped yet")
    check_own_parameters(optimizer, module, ": FSDP shards the model's parameters in prepare() and hands the optimizer "
                         "the sharded ones, so build the optimizer over model.parameters()")


def _rebind(optimizer: Any, before: dict[int, str], module: torch.nn.Module) -> None:
    """fully_shard replaces each parameter by a DTensor one: the optimizer built before ``prepare`` takes the new ones.

    State an optimizer makes when it is built (Adagrad's ``sum``, filled with its initial value) is sharded as its
    parameter is.
    """
    after = dict(module.named_parameters())
    moved = {after[before[id(p)]]: {key: _sharded_like(value, after[before[id(p)]]) for key, value in state.items()}
             for p, state in optimizer.state.items()}
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)]] for p in group["params"]]
    optimizer.state.clear()
    optimizer.state.update(moved)


def _sharded_like(value: Any, param: Any) -> Any:
    """A state tensor of the parameter's shape, placed as the (DTensor) parameter is; other values as they are."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    full = whole(value)  # split by tensor parallelism before FSDP
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements)


class _FSDPExtended(StrategyExtended):
    collective_forward = True  # a forward all-gathers parameters: every rank evaluates
    places_itself = True  # fully_shard moves each unit to the GPU as it shards it: the whole model is never there

    def __init__(self, device: str, collectives: Any, mesh: Any, options: dict, wrap: Sequence[str],
                 init_from: str = "every_rank"):
        super().__init__([device], collectives)
        self.mesh, self.options, self.wrap, self.init_from = mesh, options, list(wrap), init_from

    @property
    def _from_rank0(self) -> bool:
        return self.init_from == "rank0" and self.mesh is not None

    def _scope(self) -> Any:
        if self._from_rank0 and self._proc.rank != 0:  # rank 0's values are sent here after sharding
            return MetaScope(super()._scope())
        return super()._scope()

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        if self.mesh is None:
            wrapped_units(module, self.wrap)  # a bad name fails on one process too, before the first step
            log.warning("strategy=fsdp on one process shards nothing: it trains as strategy=one_device would")
            return module.to(self._devices[0]), optimizer
        if not self._from_rank0:
            return shard(module, optimizer, self.mesh, self.options, self.wrap), optimizer
        if optimizer is not None and optimizer.state:
            raise ValueError(f"strategy.init_from=rank0: {type(optimizer).__name__} made state when it was built, which "
                             "the other ranks (built on the meta device) cannot have; use strategy.init_from=every_rank")
        full = {k: v.detach() for k, v in module.state_dict().items()} if self._proc.rank == 0 else {}
        sharded = shard(module, optimizer, self.mesh, self.options, self.wrap)
        fill_from_rank0(sharded, full, self._devices[0], self._proc.rank)
        return sharded, optimizer


def fill_from_rank0(module: torch.nn.Module, full: dict[str, torch.Tensor], device: torch.device, rank: int) -> None:
    """The other ranks built ``module`` on the meta device: their shards are made on ``device`` and filled from
    rank 0's whole tensors (``full``; empty elsewhere), as torch's ``set_model_state_dict`` broadcasts them. Buffers
    kept out of the state dict (``persistent=False``) are broadcast one by one, and rank 0's CPU generator, which
    drew the values, so that what the recipe draws after the model (its data, a split) is the same on every rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if rank != 0:
        module.to_empty(device=device)
    saved = set(module.state_dict())
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in module.named_buffers():
        if name not in saved:
            dist.broadcast(buffer, src=0)
    rng = [torch.get_rng_state()]  # rank 0 drew the initial values: every rank's next draws are its draws again
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])


def fsdp_options(reshard_after_forward: bool, param_dtype: torch.dtype | None) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments: bf16 ``param_dtype`` gathers and computes in it, reduces in fp32."""
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return options


def shard(module: torch.nn.Module, optimizer: Any, mesh: Any, options: dict, wrap: Sequence[str]) -> torch.nn.Module:
    """``fully_shard`` each ``wrap`` unit, then the root, over the 1-D ``mesh``; the optimizer takes the new parameters.

    Parameters that are already DTensors (tensor parallelism on a sibling mesh dim) become
    2-D DTensors: FSDP shards each rank's TP shard further over ``mesh``.
    """
    from torch.distributed.fsdp import fully_shard

    units = wrapped_units(module, wrap)
    if optimizer is not None:
        _check_optimizer(optimizer, module)
    before = {id(p): name for name, p in module.named_parameters()}
    for unit in units:
        fully_shard(unit, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    if optimizer is not None:
        _rebind(optimizer, before, module)
    return module


class FSDPStrategy(Strategy):
    """Sharded data parallelism: FSDP2 ``fully_shard`` over every process of the job (a 1-D DeviceMesh).

    Args:
        reshard_after_forward: free gathered parameters after each unit's forward.
        wrap: names of the module classes sharded as their own units; empty: the root alone.
        param_dtype: compute dtype of the gathered parameters (bf16 for mixed precision);
            gradients are reduced in fp32 and the sharded master weights stay fp32.
        device_type: "cpu" or "cuda"; default: CUDA when visible.
        init_from: "every_rank" (each rank builds the whole model on the CPU, from the same seed) or "rank0"
            (rank 0 alone does; the others build it on the meta device and get rank 0's values once it is
            sharded: one copy of the model in host memory, not one per rank).
        env: where this process sits in the job; default: what the launcher put in the environment.
    """

    def __init__(self, reshard_after_forward: bool = True, wrap: Sequence[str] = (), *,
                 param_dtype: torch.dtype | None = None, device_type: str | None = None,
                 timeout_s: float = 300.0, env: Any = "from-environment", init_from: str = "every_rank"):
        from launcher.cluster.env import WorkerEnv
        from launcher.cluster.process_group import ensure_process_group, process_device

        env = WorkerEnv.from_environ() if env == "from-environment" else env
        kind = device_type or ("cuda" if devlib.default_local_devices()[0].startswith("cuda") else "cpu")
        grouped = ensure_process_group(env, None, timeout_s, kind)
        options = fsdp_options(reshard_after_forward, param_dtype)
        mesh, collectives = None, None
        if grouped:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(kind, (dist.get_world_size(),), mesh_dim_names=("shard",))
            collectives = ProcessCollectives()
        device = devlib.canonical_name(process_device(env, kind)) if grouped else ("cuda:0" if kind == "cuda" else "cpu:0")
        from launcher.cluster.resolvers import of_launched_job

        resolver = of_launched_job(env, kind) if grouped else None
        super().__init__(_FSDPExtended(device, collectives, mesh, options, wrap, init_from), cluster_resolver=resolver)

    @property
    def mesh(self) -> Any:
        """The 1-D ``("shard",)`` DeviceMesh the parameters are sharded over (None in one process)."""
        return self._extended.mesh


def param_dtype(runtime: Runtime) -> torch.dtype | None:
    """bf16 under ``trainer.precision=bf16-mixed`` (FSDP's MixedPrecisionPolicy); None keeps the model's dtype."""
    precision = runtime.run_spec.trainer.precision if runtime.run_spec is not None else "fp32"
    return torch.bfloat16 if precision == "bf16-mixed" else None


def from_spec(spec: Any, runtime: Runtime) -> FSDPStrategy:
    return FSDPStrategy(spec.reshard_after_forward, spec.wrap, param_dtype=param_dtype(runtime),
                        device_type=runtime.device_type, timeout_s=runtime.collective_timeout_s, env=runtime.env,
                        init_from=spec.init_from)
