"""``Layout``: one (world size, degree, replicate degree) and the ranks' places in its mesh.

The validity rules are the strategy's own: ``lightning_ep.parallel.mesh.check_layout`` (the degree
divides the world size, ``replicate_degree * degree`` divides it too) and the expert-parallel
transform's (the degree divides the expert count, ``lightning_ep.parallel.expert``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ep.parallel.mesh import check_layout


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A world of ``world`` ranks, ``gpus_per_node`` per node, on the ``("replicate", "edp", "ep")``
    mesh (``lightning_ep.init_mesh``): rank ``r`` sits at ``(r // S, (r % S) // d, r % d)`` with
    ``S = world / replicate_degree`` the shard size."""

    world: int
    degree: int
    replicate_degree: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"Layout(world={self.world!r}): pass the number of GPUs, an int >= 1.")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Layout(gpus_per_node={self.gpus_per_node!r}): pass an int >= 1.")
        check_layout(self.world, self.degree, self.replicate_degree)

    @property
    def shard(self) -> int:
        """Ranks a dense parameter is sharded over (``edp x ep``)."""
        return self.world // self.replicate_degree

    @property
    def edp(self) -> int:
        """Ranks an expert's weights are sharded over by FSDP2 (``world / (replicate * degree)``)."""
        return self.shard // self.degree

    @property
    def experts_sharded(self) -> bool:
        """Whether FSDP2 wraps the experts (``shard_model``: only when ``replicate x edp > 1``)."""
        return self.replicate_degree * self.edp > 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replicate, edp, ep)`` coordinates of ``rank``."""
        return rank // self.shard, (rank % self.shard) // self.degree, rank % self.degree

    def spans_nodes(self, group_size: int) -> bool:
        """Whether a group of ``group_size`` consecutive ranks crosses a node boundary."""
        return group_size > self.gpus_per_node


def valid_layouts(world: int, num_experts: int, *, gpus_per_node: int = 8) -> list[Layout]:
    """Every layout the strategy accepts for ``world`` ranks and ``num_experts`` experts per layer,
    smallest degree first, then smallest replicate degree."""
    layouts = []
    for degree in range(1, world + 1):
        if world % degree or num_experts % degree:
            continue
        for replicate in range(1, world // degree + 1):
            if world % (replicate * degree) == 0:
                layouts.append(
                    Layout(world=world, degree=degree, replicate_degree=replicate, gpus_per_node=gpus_per_node)
                )
    return layouts
