"""``Layout``: the one place that says which layouts are valid (the mesh, the planner, the
strategy, the expert-parallel transform and the dispatchers all ask it). The rules: the
expert-parallel degree ``d`` divides the world size ``W``; ``R * d`` divides it too (``R`` the
replicate degree of hybrid sharding); ``d`` divides the expert count of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A world of ``world`` ranks, ``gpus_per_node`` per node, on the ``("replicate", "edp", "ep")``
    mesh (``lightning_ep.init_mesh``): rank ``r`` sits at ``(r // S, (r % S) // d, r % d)`` with
    ``S = world / replicate_degree`` the shard size. ``num_experts``: the experts of one layer, when
    known; the degree must divide it. Raises ``TypeError`` / ``ValueError`` naming the argument, its
    value and the valid choices.
    """

    world: int
    degree: int
    replicate_degree: int = 1
    gpus_per_node: int = 8
    num_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("world", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = "the number of GPUs, " if name == "world" else ""
                raise ValueError(f"Layout({name}={value!r}): pass {what}an int >= 1.")
        for name in ("degree", "replicate_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        world, degree, replicate = self.world, self.degree, self.replicate_degree
        if world % degree:
            raise ValueError(
                f"degree={degree} does not divide the world size {world}; choose one of {_divisors(world)}."
            )
        if world % (replicate * degree):
            raise ValueError(
                f"world size {world} is not divisible by replicate_degree * degree = {replicate} * {degree}; "
                f"with degree={degree} choose replicate_degree in {_divisors(world // degree)}."
            )
        if self.num_experts is not None:
            self.local_experts(self.num_experts)

    @staticmethod
    def fits(world: int, degree: int, replicate_degree: int = 1, num_experts: int | None = None) -> bool:
        """Whether these numbers make a valid layout."""
        try:
            Layout(world=world, degree=degree, replicate_degree=replicate_degree, num_experts=num_experts)
        except (TypeError, ValueError):
            return False
        return True

    def local_experts(self, num_experts: int, where: str = "") -> int:
        """``L = E / d`` for a layer of ``num_experts`` (``where`` names it in the error, with the fixes)."""
        degree = self.degree
        if num_experts % degree == 0:
            return num_experts // degree
        span, divisors = self.shard, _divisors(num_experts)
        valid = [d for d in divisors if span % d == 0]
        larger = [d for d in divisors if d > max(valid)]
        ranks = f"world size / replicate_degree = {span}" if self.replicate_degree > 1 else f"the world size {span}"
        other_world = ""
        if larger:
            other_world = (
                f", or a world size / replicate_degree that is a multiple of one of {larger} to use it as the degree"
            )
        raise ValueError(
            f"degree={degree} does not divide the number of experts {num_experts}{where}; choose a degree that "
            f"divides both the expert count and {ranks}: one of {valid}. Otherwise use an expert count that is a "
            f"multiple of {degree}{other_world}."
        )

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
    """Every valid layout for ``world`` ranks and ``num_experts`` experts, by degree then replicate degree."""
    return [
        Layout(world=world, degree=d, replicate_degree=r, gpus_per_node=gpus_per_node)
        for d in range(1, world + 1)
        for r in range(1, world // d + 1)
        if Layout.fits(world, d, r, num_experts)
    ]
