"""Where a scheduler put this process: SLURM (or submitit's local executor) tasks as dlaunch nodes.

Under ``hydra/launcher=submitit_slurm`` each SLURM task runs one node of the
cluster: its elastic agent starts that node's workers. The node rank and the
master address come from SLURM's variables, through ``SlurmClusterResolver``;
the rendezvous port is derived from the job id so every task agrees on it.
"""

from __future__ import annotations

import logging

from launcher.cluster import env as env_lib
from launcher.cluster.resolvers import SlurmClusterResolver
from launcher.config.schema import ClusterSpec

log = logging.getLogger("dlaunch")
PORT_BASE, PORT_SPAN = 20000, 20000


class PlacementError(ValueError):
    """The scheduler's tasks do not match the cluster (e.g. several tasks per node)."""


def placed(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with this task's node rank and the master's address, when a scheduler placed it."""
    tasks = env_lib.scheduler_tasks()
    if not tasks or cluster.nodes == 1 or cluster.node_rank is not None:
        return cluster
    resolver = SlurmClusterResolver(environ=tasks)
    addresses = resolver.cluster_spec().as_dict()["worker"]
    if len(addresses) != cluster.nodes:
        raise PlacementError(
            f"the scheduler started {len(addresses)} task(s), but cluster {cluster.shape} has {cluster.nodes} nodes: "
            f"run one task per node (dlaunch sets hydra.launcher.tasks_per_node=1 and nodes={cluster.nodes} itself)"
        )
    host = addresses[0].rsplit(":", 1)[0]
    master = "127.0.0.1" if host == "localhost" else host
    port = cluster.master_port or PORT_BASE + int(tasks.get("SLURM_JOB_ID", "0") or 0) % PORT_SPAN
    log.info("scheduler task %d of %d: node %d, rendezvous at %s:%d", resolver.task_id, len(addresses), resolver.task_id, master, port)
    env_lib.narrow_local_task_devices(resolver.task_id, cluster.devices_per_node)
    return cluster.model_copy(update={"node_rank": resolver.task_id, "master_addr": master, "master_port": port})
