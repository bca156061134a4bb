"""Where each rank sits in the device mesh: ranks ordered node by node, then cut into
tensor-parallel groups (innermost, always inside one node), shard groups (HSDP: inside a node
unless made of whole nodes) and replicas (across nodes).

Ray Train numbers its workers without regard to where they run (ray#45799: 8 ranks on one
node, then 1 on each other node), and a process group built on those numbers would put a
shard group across the slow link between nodes. The mesh is therefore built from an explicit
rank layout: node by node, nodes in the order of their lowest rank (rank 0's node first, so
the chief stays data-parallel rank 0), ranks ascending within a node.

Nodes that hold different numbers of workers (a node lost, a partial placement) are handled
by one rule: the default shard group is the greatest common divisor of the nodes' worker
counts, so no group crosses a node (4 + 4 + 2 workers: 5 groups of 2). A `shard_size` given
explicitly must cut the layout into groups that each lie in one node or are made of whole
nodes; anything else is refused, naming the nodes. Pure Python and torch: no Ray here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raytrain_lm.errors import UserError


def node_contiguous_order(node_ids: Sequence[str]) -> list[int]:
    """Ranks (indices of `node_ids`, each rank's node) grouped node by node: nodes in the order
    of their lowest rank, ranks ascending within each."""
    first_rank: dict[str, int] = {}
    for rank, node in enumerate(node_ids):
        first_rank.setdefault(node, rank)
    return sorted(range(len(node_ids)), key=lambda r: (first_rank[node_ids[r]], r))


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{node[:8]}: {n}" for node, n in counts.items())


@dataclass(frozen=True)
class Layout:
    """The mesh's shape and which rank sits where. `order[i]` is the rank at flat position i
    of the mesh (replicate, shard, tensor), the tensor dimension innermost."""

    strategy: str  # ddp | fsdp | hsdp
    replicate: int
    shard: int
    tensor: int
    order: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.order)

    @property
    def data_world(self) -> int:
        """Ranks that read different data: a tensor-parallel group reads the same sequences."""
        return self.world // self.tensor

    def data_rank(self, rank: int) -> int:
        """Which share of each batch `rank` reads: its own rank unless it is in a
        tensor-parallel group, whose ranks read the group's share together."""
        return rank if self.tensor == 1 else self.order.index(rank) // self.tensor

    def tensor_rank(self, rank: int) -> int:
        return 0 if self.tensor == 1 else self.order.index(rank) % self.tensor

    @property
    def state_divisor(self) -> int:
        """Into how many parts each worker's copy of the training state is cut."""
        return self.shard * self.tensor

    def describe(self) -> str:
        if self.strategy == "ddp":
            return f"ddp over {self.world} workers"
        dims = [("replicate", self.replicate)] if self.strategy == "hsdp" else []
        dims += [("shard", self.shard)] + ([("tensor", self.tensor)] if self.tensor > 1 else [])
        shape = " x ".join(f"{n} ({name})" for name, n in dims)
        return f"{self.strategy}: mesh {shape}"


def plan_layout(
    strategy: str,
    node_ids: Sequence[str],
    shard_size: int | None = None,
    tensor_parallel: int = 1,
) -> Layout:
    """The mesh for `strategy` over the ranks whose nodes are `node_ids` (rank order), or a
    one-line UserError saying which nodes stop it."""
    world, tp = len(node_ids), tensor_parallel
    order = node_contiguous_order(node_ids)
    counts: dict[str, int] = {}
    for rank in order:
        counts[node_ids[rank]] = counts.get(node_ids[rank], 0) + 1
    if strategy == "ddp":
        if tp > 1:
            raise UserError("parallel.tensor_parallel composes with fsdp or hsdp, not ddp")
        return Layout("ddp", world, 1, 1, tuple(order))
    if any(n % tp for n in counts.values()):
        raise UserError(
            f"parallel.tensor_parallel={tp} keeps each group inside one node, but the nodes "
            f"hold {_describe(counts)} workers; each must hold a multiple of {tp}"
        )
    if strategy == "fsdp":
        return Layout("fsdp", 1, world // tp, tp, tuple(order))
    if shard_size is None:
        group = math.gcd(*counts.values())
    else:
        group = shard_size * tp
        if world % group:
            raise UserError(
                f"parallel.shard_size={shard_size} x tensor_parallel={tp} does not divide the "
                f"{world} workers"
            )
        _check_groups_follow_nodes(order, node_ids, counts, group, shard_size)
    return Layout("hsdp", world // group, group // tp, tp, tuple(order))


def _check_groups_follow_nodes(
    order: list[int], node_ids: Sequence[str], counts: dict[str, int], group: int, shard: int
) -> None:
    """Each shard group of `group` consecutive ranks of `order` lies in one node or is made of
    whole nodes: a group split across a node boundary would send its every all-gather over
    the network for the sake of a few ranks."""
    for start in range(0, len(order), group):
        nodes = {node_ids[r] for r in order[start : start + group]}
        inside = {
            n: sum(1 for r in order[start : start + group] if node_ids[r] == n) for n in nodes
        }
        if len(nodes) > 1 and any(inside[n] != counts[n] for n in nodes):
            raise UserError(
                f"parallel.shard_size={shard} puts a shard group across part of a node: nodes "
                f"hold {_describe(counts)} workers; choose a size that divides each node's "
                "workers or spans whole nodes, or leave it unset"
            )


def build_meshes(layout: Layout, device_type: str):
    """(data-parallel mesh for fully_shard, tensor-parallel mesh or None). The data-parallel
    mesh is 1-D (shard) under fsdp, 2-D (replicate, shard) under hsdp; the tensor dimension is
    innermost. Every rank calls this at the same point: it creates the process groups.

    Each group is made here, its ranks in the layout's order (`sort_ranks=False`): FSDP2 cuts
    a parameter by a rank's place in its group, DTensor and DCP by its place in the mesh, and
    DeviceMesh's own groups would be sorted (or, spanning the world, the default group in rank
    order), silently swapping shards whenever Ray's numbering interleaves the nodes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dims = [("replicate", layout.replicate)] if layout.strategy == "hsdp" else []
    dims.append(("shard", layout.shard))
    if layout.tensor > 1:
        dims.append(("tensor", layout.tensor))
    names = tuple(name for name, _ in dims)
    ranks = torch.tensor(layout.order).view(*(n for _, n in dims))
    me, mine = dist.get_rank(), []
    for d in range(ranks.dim()):
        found = None
        for members in ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist():
            group = dist.new_group(ranks=members, sort_ranks=False)  # every rank, every group
            if me in members:
                found = group
        mine.append(found)
    mesh = DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=names)
    data = mesh["replicate", "shard"] if layout.strategy == "hsdp" else mesh["shard"]
    return data, (mesh["tensor"] if layout.tensor > 1 else None)
