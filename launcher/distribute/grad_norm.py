"""The total norm of gradients that live in different layouts, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` takes gradients of one kind: all plain
tensors, or DTensors on one mesh. A tensor-parallel model whose other layers are
not split has both, and FSDP x TP has DTensors on two meshes; torch's
``_foreach_norm`` and ``stack`` refuse the mix. Here the gradients are grouped by
layout, each group's norm is made whole (a DTensor's ``full_tensor``, ``dtensors.whole``), the norms
are combined, and each group is scaled by the one clip factor with
``torch.nn.utils.clip_grads_with_norm_``, as torchtitan does for its meshes.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

import torch
from torch.distributed.tensor import DTensor

from launcher.distribute.dtensors import own_reads, whole


def _layout(t: torch.Tensor) -> Hashable:
    if isinstance(t, DTensor):
        return ("dtensor", t.device_mesh, t.placements)
    return ("plain", t.device)


def clip_grad_norm(params: Iterable[Any], max_norm: float | None) -> torch.Tensor | None:
    """The total norm of ``params``' gradients, a plain tensor (None if none has one; split DTensor gradients count
    whole), then, with ``max_norm``, the gradients scaled so that it is at most ``max_norm`` (what
    ``clip_grad_norm_`` does for gradients of one layout)."""
    groups: dict[Hashable, list[Any]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_layout(p.grad), []).append(p)
    if not groups:
        return None
    with own_reads():  # a norm of grads split over two mesh dims reduces over each
        norms = [whole(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups.values()]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms]))
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def averaged_grad_norm(model: Any, optimizer: Any, max_norm: float | None) -> torch.Tensor | None:
    """The total norm of the averaged gradients of ``model``; clipped to ``max_norm`` when given.

    An optimizer that averages at ``step()`` (the mesh's) does it here instead, so the
    norm is the averaged gradients'. Split (DTensor) gradients give their full norm.
    """
    own = getattr(optimizer, "clip_grad_norm_", None)
    if own is not None:
        return own(max_norm)
    return clip_grad_norm(model.parameters(), max_norm)
