"""``trainer.pretrained``: a run's first weights from another run's checkpoint or a state-dict file (a fine-tune).

Weights only: the optimizer, the schedule, the step and the data position start afresh, where ``trainer.resume``
goes on with all of them. The source is a dlaunch checkpoint (``step-N``, or a directory of them, or a run
directory: the newest intact one), any torch.distributed.checkpoint directory, a ``torch.save``'d state dict
(read with ``weights_only=True``) or a ``.safetensors`` file. Before anything starts, the parent matches its
tensors with the model (built on the meta device) by name and shape; each worker then loads its part (DCP
reshards a checkpoint; ``set_model_state_dict`` splits a whole tensor across DTensor shards).

    trainer.pretrained.path=outputs/pretrain/checkpoints trainer.pretrained.strict=false   # a new head stays as built
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

from launcher.checkpoint import layout
from launcher.checkpoint.errors import CheckpointError

log = logging.getLogger("dlaunch")
_WRAPPERS = ("state_dict", "model", "module")  # a file holding {"state_dict": {...}, "epoch": 3}: the dict inside
Shapes = dict[str, tuple[int, ...]]


@dataclasses.dataclass
class Match:
    """The source's tensors against the model's: what loads, and what differs."""

    load: list[str]
    missing: list[str]  # the model's, not in the source: they keep build()'s values
    unexpected: list[str]  # the source's, not in the model
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (name, in the source, here)

    @property
    def total(self) -> int:
        return len(self.load) + len(self.missing) + len(self.mismatched)

    def differences(self) -> str:
        shapes = [f"{n} {list(there)} there, {list(here)} here" for n, there, here in self.mismatched]
        parts = [_listed("not in it", self.missing), _listed("only in it", self.unexpected), _listed("of another shape", shapes)]
        return "; ".join(filter(None, parts))

    def problem(self, strict: bool, it: str = "it") -> str | None:
        """Why the load cannot go ahead (None: it can). ``it``: the source, as the message names it."""
        if not self.load:
            return f"none of the model's {self.total} tensors is in {it} by name and shape ({self.differences()})"
        if strict and (self.missing or self.unexpected or self.mismatched):
            return (f"{len(self.load)} of the model's {self.total} tensors match {it.rstrip(',')} ({self.differences()}); "
                    "trainer.pretrained.strict=false loads those and keeps build()'s values for the rest (a new head)")
        return None

    def said(self) -> str:
        kept = [*self.missing, *(n for n, _, _ in self.mismatched)]
        rest = f"; kept as built: {_names(kept, 4)}" if kept else ""
        unused = f"; not used: {_names(self.unexpected, 4)}" if self.unexpected else ""
        return f"{len(self.load)} of the model's {self.total} tensors{rest}{unused}"


def match(here: Shapes, there: Shapes) -> Match:
    both = [n for n in here if n in there]
    return Match(load=[n for n in both if here[n] == there[n]], missing=[n for n in here if n not in there],
                 unexpected=[n for n in there if n not in here],
                 mismatched=[(n, there[n], here[n]) for n in both if here[n] != there[n]])


def source(given: str) -> Path:
    """The file or checkpoint directory ``given`` names; a directory of dlaunch checkpoints (or a run directory
    with ``checkpoints/``) gives its newest intact one. CheckpointError where there is none."""
    path = layout.marked(Path(given))  # dlaunch's marker of its newest (or best) checkpoint: that one
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist")
    if (path / layout.MANIFEST).is_file() or (path / ".metadata").is_file():
        why = layout.check(path) if (path / layout.MANIFEST).is_file() else None
        if why:
            raise CheckpointError(f"{path} cannot be loaded: {why}")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = layout.complete_steps(root)
    for step in reversed(steps):
        if layout.check(step) is None:
            return step
    found = f"its {len(steps)} checkpoint(s) are damaged" if steps else \
        "it holds no checkpoint (a run that saved to its own trainer.checkpoint.dir: name that directory)"
    raise CheckpointError(f"{path}: {found}; allowed: a checkpoint (step-N), a directory of them, a run directory, "
                          "a torch.save'd state dict (.pt) or a .safetensors file")


def saved_shapes(path: Path, names: Any = ()) -> Shapes:
    """The model tensors' names and shapes in the source, without reading their values where the format allows.
    ``names``: the model's, which decide whether a DCP directory holds the model under ``model.`` (``_prefix``)."""
    if path.is_dir():
        from launcher.checkpoint.safe import saved_entries

        return {n: tuple(e.size) for n, e in saved_entries(path, _prefix(path, names)).items() if hasattr(e, "size")}
    held = _safetensors_shapes(path) if path.suffix == ".safetensors" else _read_file(path)
    return {name: tuple(getattr(t, "shape", t)) for name, t in as_model_names(held, names)[0].items()}


def as_model_names(held: dict[str, Any], names: Any) -> tuple[dict[str, Any], str]:
    """A file's tensors by the model's ``names``, and the prefix dropped: a state dict saved from a wrapper has its
    names under one (``module.`` from DDP, ``model.`` from a LightningModule, ``_orig_mod.`` from torch.compile),
    dropped where more of them then match."""
    wanted, readings = set(names), [(held, "")]  # each prefix shared by every name, dropped one after the other
    while wanted and all("." in k for k in readings[-1][0]) and len({k.split(".", 1)[0] for k in readings[-1][0]}) == 1:
        inner, dropped = readings[-1]
        prefix = next(iter(inner)).split(".", 1)[0] + "."
        readings.append(({k[len(prefix):]: v for k, v in inner.items()}, dropped + prefix))
    return max(readings, key=lambda reading: len(wanted & set(reading[0])))  # the first of the best: the least dropped


def verified(spec: Any, run_dir: Path, resume_from: Path | None) -> Path | None:
    """In the parent: the source the workers load (None: none, or the run resumes instead), matched with the model.
    ConfigError naming ``trainer.pretrained.path`` where it cannot be loaded."""
    given = spec.trainer.pretrained.path
    if given is None or resume_from is not None or spec.script is not None:
        return None
    from launcher.checkpoint.fit import model_shapes
    from launcher.config.errors import ConfigError, Problem

    try:
        path = source(given)
        _not_this_runs_own(path, spec, run_dir)
        here = model_shapes(spec, run_dir)  # {}: the recipe would not build here; the workers' load says it then
        there = saved_shapes(path, here)
        if not there:
            raise CheckpointError(f"{path} holds no model tensors")
        found = match(here, there) if here else None
        it = "it" if path == Path(given) else f"{path.name}, its newest checkpoint,"
        why = found and found.problem(spec.trainer.pretrained.strict, it)
        if why:
            raise CheckpointError(why)
    except CheckpointError as exc:
        raise ConfigError([Problem(key="trainer.pretrained.path", value=given, message=str(exc))]) from None
    said = found.said() if found else "matched with the model as each worker loads it"
    log.info("pretrained: from %s: %s", path, said)
    return path


def _not_this_runs_own(path: Path, spec: Any, run_dir: Path) -> None:
    """A checkpoint of this run's own directory, which this run's saves set aside (a start at step 0 replaces its
    later timeline): a restart would find the weights gone."""
    root = spec.trainer.checkpoint.root(run_dir).resolve()
    if spec.trainer.checkpoint.every_steps and root in path.resolve().parents:
        raise CheckpointError(f"{path} is a checkpoint of this run's own directory, which this run's saves set aside "
                              "as it starts afresh; copy it elsewhere first, or go on from it with trainer.resume=PATH")


def load(path: Path, model: Any, strict: bool) -> Match:
    """In each worker: the source's weights into ``model`` (collective under DTensor); the match loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from launcher.checkpoint.state import unwrap

    module = unwrap(model)
    current = get_model_state_dict(module)
    held = None if path.is_dir() else as_model_names(_read_file(path), current)[0]  # read once (memory-mapped)
    there = saved_shapes(path, current) if held is None else {n: tuple(t.shape) for n, t in held.items()}
    found = match({n: tuple(t.shape) for n, t in current.items()}, there)
    why = found.problem(strict)
    if why:
        raise CheckpointError(f"trainer.pretrained: {path}: {why}")
    tied = _tied(module, found.load)
    if held is None:
        from launcher.checkpoint import _load

        prefix = _prefix(path, current)
        # DCP reads each rank's part into the model's own tensors; a tied name's into a tensor of its own
        tensors = {prefix + n: current[n].new_empty(current[n].shape) if n in tied else current[n] for n in found.load}
        _load(tensors, path)
        values, whole = {n: tensors[prefix + n] for n in found.load}, False
    else:  # whole tensors: set_model_state_dict gives each DTensor shard its part
        values, whole = {n: held[n] for n in found.load}, any(isinstance(t, DTensor) for t in current.values())
    _one_value_each(values, tied, path)
    set_model_state_dict(module, values, options=StateDictOptions(full_state_dict=whole, strict=False))
    if hasattr(model, "resync"):  # mirrored copies in one process follow their primary
        model.resync()
    return found


def _tied(module: Any, loaded: list[str]) -> dict[str, str]:
    """The model's names of a tensor that another name holds too (a decoder's head tied to its embedding), each to
    the first name it has (the one its ``parameters()`` give), where the source has both."""
    first: dict[int, str] = {}
    tied = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        owner = first.setdefault(id(tensor), name)
        if owner != name and {owner, name} <= set(loaded):
            tied[name] = owner
    return tied


def _one_value_each(values: dict[str, Any], tied: dict[str, str], path: Path) -> None:
    """A tied tensor takes its first name's value, as Hugging Face's loading does; where the source holds another
    value under the other name (it was trained untied), which is said once, not left to the order of the load."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    differ = [f"{alias} (tied to {owner})" for alias, owner in tied.items()
              if not local(values[alias]).cpu().equal(local(values[owner]).cpu())]
    for alias in tied:
        values.pop(alias)
    import torch.distributed as dist

    if differ and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("trainer.pretrained: %s holds other values for %s than for the name it is tied to; the model "
                    "holds one tensor for both, and takes the first name's", path, _names(differ, 3))


def agree(path: Path) -> None:
    """Every rank loads the same source: each node's dlaunch chose it (a directory's newest checkpoint), and a run
    still saving there could give the nodes different ones, with no error after."""
    import hashlib

    from launcher.checkpoint import extremes

    low, high = extremes(int(hashlib.sha256(str(path).encode()).hexdigest()[:15], 16))
    if low != high:
        raise CheckpointError(f"trainer.pretrained: the nodes chose different sources (this rank: {path}); give every "
                              "node the same checkpoint (a step-N directory, not a directory another run still saves to)")


def _prefix(path: Path, names: Any) -> str:
    """dlaunch keeps the model under ``model.``; another DCP checkpoint may hold the model's names alone, and a model
    may have a submodule called ``model``: the reading under which more of the model's ``names`` are found."""
    from launcher.checkpoint.safe import saved_entries

    if (path / layout.MANIFEST).is_file():
        return "model."
    under, alone = set(saved_entries(path, "model.")), set(saved_entries(path, ""))
    return "model." if under and len(under & set(names)) >= len(alone & set(names)) else ""


def _read_file(path: Path) -> dict[str, Any]:
    """A file's state dict (memory-mapped: a shape costs no read), with ``weights_only=True``."""
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    import torch

    try:
        try:
            held = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # a file from before torch's zip format cannot be mapped
            if "mmap" not in str(exc):
                raise
            held = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not zipfile.is_zipfile(path) and "Unsupported operand" in str(exc):  # not a pickle at all
            raise CheckpointError(f"{path} is not a torch.save file") from None
        raise CheckpointError(f"{path} holds objects other than tensors, which are not loaded (weights_only=True); "
                              "save the state dict alone: torch.save(model.state_dict(), PATH)") from None
    except Exception as exc:  # noqa: BLE001 - torch's unpickler fails in many ways on a file that is not its own
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{path} cannot be read as a torch.save file ({type(exc).__name__}: {first})") from None
    return _state_dict_in(held, path)


def _state_dict_in(held: Any, path: Path) -> dict[str, Any]:
    import torch

    def tensors(d: Any) -> bool:
        return isinstance(d, dict) and bool(d) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items())

    if tensors(held):
        return held
    inside = [k for k in _WRAPPERS if isinstance(held, dict) and tensors(held.get(k))]
    if inside:
        return held[inside[0]]
    what = f"a dict with keys {_names([str(k) for k in held], 4)}" if isinstance(held, dict) else f"a {type(held).__name__}"
    raise CheckpointError(f"{path} holds {what}, not a state dict (names to tensors, or one under "
                          f"{', '.join(_WRAPPERS)})")


def _read_safetensors(path: Path) -> dict[str, Any]:
    return _safetensors(path, lambda module: module.torch.load_file(str(path)))


def _safetensors_shapes(path: Path) -> Shapes:
    """The names and shapes from the file's header alone."""
    def shapes(module: Any) -> Shapes:
        with module.safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    return _safetensors(path, shapes)


def _safetensors(path: Path, read: Any) -> Any:
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 - read() uses it
    except ImportError:
        raise CheckpointError(f"{path} is a .safetensors file, which needs the safetensors package: "
                              "pip install safetensors") from None
    try:
        return read(safetensors)
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors, said with the path
        raise CheckpointError(f"{path} cannot be read as a .safetensors file: {exc}") from None


def _names(names: list[str], shown: int) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _listed(what: str, names: list[str]) -> str:
    return f"{len(names)} {what}: {_names(names, 2)}" if names else ""
