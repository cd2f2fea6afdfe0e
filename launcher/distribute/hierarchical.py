"""``HierarchicalCopyAllReduce``: within each node, then among the nodes' leaders (``tf.distribute``'s name)."""

from __future__ import annotations

import dataclasses
import socket
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.cross_device_ops import CrossDeviceOps, non_negative


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    """The nodes of a process group and the subgroups hierarchical reduction runs in."""

    nodes: tuple[tuple[int, ...], ...]  # group ranks per node; the first of each is its leader
    node_group: Any  # this rank's node as a process group; None when the node has one process
    leaders_group: Any  # the leaders as a process group, on leaders only; None with one node


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduction using hierarchical copy all-reduce: within nodes, then across them.

    Between processes: ``dist.reduce`` to the node's leader (its lowest rank),
    ``dist.all_reduce`` among the leaders, then ``dist.broadcast`` from the leader
    within the node, each in its own subgroup. The subgroups are built once per
    process group, by every rank in the same order. Nodes come, in this order,
    from ``ranks_per_node``, from the worker env's node rank (``GROUP_RANK``
    under torch.distributed.elastic), or from the host name. With one node it is
    an intra-node reduce and broadcast.

    Between the thread replicas of one process (one node) the values are summed
    on the first replica's device, the node leader, by its thread and copied
    back; TF's split of many GPUs into two sub-trees is not reproduced.

    Args:
        num_packs: as for ``NcclAllReduce``.
        ranks_per_node: override the topology: ranks ``[0, n)`` are node 0, ``[n, 2n)``
            node 1, ... (e.g. 2 to run 2 "nodes" of 2 ranks on one machine).
    """

    name = "hierarchical_copy"

    def __init__(self, num_packs: int = 1, *, ranks_per_node: int | None = None):
        self.num_packs = non_negative("num_packs", num_packs)
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        self.ranks_per_node = ranks_per_node
        self._env_node: int | None = None
        self._topologies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> NodeTopology

    def topology(self, group: Any = None) -> NodeTopology:
        """This op's topology for ``group`` (default: the whole job), built on first use by every rank.

        Every process of the job takes part in building it (``new_group``'s rule), so
        ``group`` must span the job; strategies build it when they join the group.
        """
        key = group if group is not None else dist.group.WORLD
        if key not in self._topologies:
            self._topologies[key] = self._build_topology(group)
        return self._topologies[key]

    def _join(self, processes: ProcessCollectives, env: Any) -> None:
        if env is not None:
            self._env_node = env.group_rank
        self.topology(processes.group)

    def _node_key(self, rank: int) -> Any:
        if self.ranks_per_node is not None:
            return rank // self.ranks_per_node
        if self._env_node is not None:
            return self._env_node
        return socket.gethostname()

    def _build_topology(self, group: Any) -> NodeTopology:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        keys: list[Any] = [None] * size
        dist.all_gather_object(keys, self._node_key(rank), group=group)
        nodes: dict[Any, list[int]] = {}
        for r, key in enumerate(keys):
            nodes.setdefault(key, []).append(r)
        ranks = [tuple(members) for members in nodes.values()]

        def to_global(members: Sequence[int]) -> list[int]:
            return [dist.get_global_rank(group, r) if group is not None else r for r in members]

        # Every rank creates every subgroup, in the same order (torch's requirement).
        node_group, _ = dist.new_subgroups_by_enumeration([to_global(m) for m in ranks])
        leaders = [m[0] for m in ranks]
        leaders_group = dist.new_group(to_global(leaders)) if len(ranks) > 1 else None
        mine = next(m for m in ranks if rank in m)
        return NodeTopology(
            nodes=tuple(ranks),
            node_group=node_group if len(mine) > 1 else None,
            leaders_group=leaders_group if rank in leaders else None,
        )

    def _thread_owner(self, index: int, copies: Sequence[torch.Tensor | None]) -> int:
        return 0  # the node leader

    def _all_reduce_sum_(self, buffer: torch.Tensor, group: Any) -> None:
        topo = self.topology(group)
        if topo.node_group is not None:
            dist.reduce(buffer, group_dst=0, op=dist.ReduceOp.SUM, group=topo.node_group)
        if topo.leaders_group is not None:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=topo.leaders_group)
        if topo.node_group is not None:
            dist.broadcast(buffer, group_src=0, group=topo.node_group)

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs}, ranks_per_node={self.ranks_per_node})"
