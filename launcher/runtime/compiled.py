"""``trainer.compile``: ``torch.compile`` of the prepared model, and what to say when it cannot compile it."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from launcher.checkpoint.state import unwrap
from launcher.runtime import user_frames


class CompileError(RuntimeError):
    """``torch.compile`` could not compile the model (``trainer.compile.enabled=true``)."""

    explained = True  # the message carries torch's reason, the user's line and the way round it


def compile_model(model: Any, spec: Any) -> None:
    """``torch.compile`` the prepared model in place, after DTensor split it and after DDP wrapped it: the
    model inside DDP is compiled and runs in DDP's eager forward, so DDP's graph-break optimizer places the
    buckets (and ``fullgraph`` never meets DDP's own frames). Its state_dict keys stay the same.

    ``nn.Module.compile`` hands dynamo the module's ``_call_impl``, a torch frame that dynamo skips, and dynamo
    then traces the first frame outside torch: a user's ``forward``. A model made of torch's own modules
    (``nn.Sequential``, ``nn.Linear``) has no such frame, and nothing would be compiled. Such a model (or
    the one DDP wraps) is entered through a function of dlaunch's instead, which dynamo traces, inlining torch's
    modules (what ``torch.compile(module)`` does for them). Under FSDP2 that function is the model's ``forward``,
    so that FSDP's hooks (which dynamo does not trace) stay outside the graph.
    """
    if not spec.enabled:
        return
    # A model that fails under fake tensors is reported once, by compile_error; not also as torch's ERROR log.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    options = {"mode": None if spec.mode == "default" else spec.mode, "fullgraph": spec.fullgraph, "dynamic": spec.dynamic}
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    target = model.module if ddp else model  # DDP's forward stays eager; the model it wraps is compiled inside it
    if not _torchs_own(target):
        target.compile(**options)
        return
    if _sharded(target):  # FSDP2's hooks in _call_impl are dynamo.disable'd: traced from there, nothing compiles
        forward = target.forward

        def module_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        target.forward = torch.compile(module_forward, **options)  # the hooks stay eager, around it
        return
    call = target._call_impl

    def module_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    target._compiled_call_impl = torch.compile(module_call, **options)  # what nn.Module.compile sets


def _sharded(module: Any) -> bool:
    """The module is FSDP2's (``fully_shard``), whose pre- and post-forward hooks dynamo does not trace."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _torchs_own(module: Any) -> bool:
    """The module's ``forward`` is torch's (dynamo skips its frames), not a user's."""
    return getattr(type(module).forward, "__module__", "").startswith("torch.")


_TRACING_ONLY = re.compile(r"\bfake\b|\bmeta\b|data.?dependent|dynamic.?output.?shape|unsupported", re.I)
_FAILED_OP = re.compile(r"got (\w+(?:Error|Exception))\((['\"])(.*?)\2\)", re.S)  # fake tensors: the op's own error


def compile_error(exc: BaseException, model: Any, fullgraph: bool = False) -> CompileError | None:
    """What a failure inside ``torch.compile`` says: the model, the cause (for an op that failed under fake
    tensors, that op's own error, as eager torch would raise it), the user's line, and what to try."""
    import torch._dynamo.exc as dynamo_exc  # loaded by torch.compile already

    if not isinstance(exc, dynamo_exc.TorchDynamoException):
        return None
    inner = unwrap(model)
    text = str(exc)
    headline = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    failed_op = _FAILED_OP.search(text)
    if failed_op:
        cause = f"{failed_op.group(1)}: {failed_op.group(3)} (torch.compile's {type(exc).__name__}: {headline})"
        advice = "The model's own code fails here: eagerly (trainer.compile.enabled=false) it would fail too"
        if _TRACING_ONLY.search(f"{failed_op.group(1)} {failed_op.group(3)}"):  # an op that runs eagerly, not traced
            advice = ("The op runs eagerly but cannot be traced (it needs a fake/meta implementation for torch.compile); "
                      "run the model eagerly with trainer.compile.enabled=false")
    else:
        cause = f"{type(exc).__name__}: {headline[:400]}"
        explanation = re.search(r"Explanation: (.*)", text)
        cause += f". {explanation.group(1).strip()[:400]}" if explanation else ""
        advice = "Run it eagerly with trainer.compile.enabled=false, or see TORCH_LOGS=graph_breaks for where it breaks"
        if fullgraph and isinstance(exc, dynamo_exc.Unsupported):
            advice = ("trainer.compile.fullgraph=true makes this graph break an error: set it false to run that part "
                      "eagerly, or change the line")
    where = _user_line(exc)
    return CompileError(f"torch.compile could not compile {type(inner).__name__} ({type(inner).__module__}): "
                        f"{cause}{where}\n{advice}")


def _user_line(exc: BaseException) -> str:
    """`` at FILE:LINE in NAME: CODE`` for the innermost frame of the user's code that dynamo was tracing; nothing
    where it traced none (a model made of torch's modules, entered through this file's ``module_call``)."""
    # the user's frames: not torch's, Python's or dlaunch's own (its entry to a torch module, activation
    # checkpointing's replay), except the shipped recipes
    frames = [f for f in getattr(exc, "real_stack", None) or [] if user_frames.is_user_file(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"\n  at {frame.filename}:{frame.lineno} in {frame.name}{code}"
