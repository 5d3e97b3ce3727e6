"""The world of a multi-node launch: how many nodes, and which one this is.

One planner runs per node (`srun --ntasks-per-node=1 autofit plan ...`, or `torchrun
--nproc-per-node=1 ... -m autofit plan ...`); each reads the launcher's environment:

- torchrun / torchelastic: `WORLD_SIZE` processes, `LOCAL_WORLD_SIZE` of them per node, this
  node's rank in `GROUP_RANK` (torch.distributed.run's documented variables);
- SLURM: `SLURM_STEP_NUM_NODES` and `SLURM_NODEID`, which srun sets for the job step it starts
  (a batch script's own shell, outside srun, runs on one node and is not a multi-node launch);
- `AUTOFIT_NODES` / `AUTOFIT_NODE_RANK`, which override both (a launcher of another kind, or tests).

Outside any launch this is one node of rank 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from autofit.errors import HardwareError

NODES_ENV = "AUTOFIT_NODES"
NODE_RANK_ENV = "AUTOFIT_NODE_RANK"


@dataclass(frozen=True)
class World:
    nodes: int = 1
    node_rank: int = 0
    source: str = "none"  # "autofit", "torchrun", "slurm" or "none"

    @property
    def leader(self) -> bool:
        """Node 0 chooses each trial; the others join its launches."""
        return self.node_rank == 0


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text.split("(")[0])  # SLURM writes some counts as "2(x3)"
    except ValueError:
        raise HardwareError(
            f"The environment variable {name}={text!r} is not a whole number; autofit reads it "
            "to learn the nodes of a multi-node launch. Unset it, or set it to a count."
        ) from None


def launch_world(env: Mapping[str, str] | None = None) -> World:
    """The nodes of the launch this process runs in (one node outside any launch)."""
    env = os.environ if env is None else env
    nodes, rank, source = _int(env, NODES_ENV), _int(env, NODE_RANK_ENV), "autofit"
    if nodes is None:
        world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
        if world and local:
            nodes, rank, source = world // local, _int(env, "GROUP_RANK"), "torchrun"
    if nodes is None:
        slurm = _int(env, "SLURM_STEP_NUM_NODES")
        if slurm:
            nodes, rank, source = slurm, _int(env, "SLURM_NODEID"), "slurm"
    if nodes is None or nodes <= 1:
        return World()
    rank = rank or 0
    if not 0 <= rank < nodes:
        raise HardwareError(
            f"This node's rank {rank} (from {source}'s environment) is not between 0 and "
            f"{nodes - 1} for a launch of {nodes} nodes; set {NODE_RANK_ENV} to this node's rank."
        )
    return World(nodes, rank, source)
