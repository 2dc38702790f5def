"""Mesh layout validation: every bad layout fails with the numbers and a valid choice."""

from __future__ import annotations

import pytest

from lightning_ep import init_mesh
from lightning_ep.parallel.mesh import check_layout


@pytest.mark.parametrize(
    ("world", "degree", "replicate", "edp"),
    [(1, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1, 2), (4, 2, 2, 1), (8, 2, 2, 2), (8, 8, 1, 1)],
)
def test_valid_layouts(world: int, degree: int, replicate: int, edp: int) -> None:
    assert check_layout(world, degree, replicate) == edp


def test_degree_not_dividing_world() -> None:
    with pytest.raises(ValueError, match=r"degree=3 does not divide the world size 4; choose one of \[1, 2, 4\]"):
        check_layout(4, 3)


def test_replicate_not_dividing() -> None:
    with pytest.raises(
        ValueError,
        match=r"world size 8 is not divisible by replicate_degree \* degree = 3 \* 2; "
        r"with degree=2 choose replicate_degree in \[1, 2, 4\]",
    ):
        check_layout(8, 2, 3)


@pytest.mark.parametrize("bad", [0, -2])
def test_degree_below_one(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"degree must be >= 1, got {bad}"):
        check_layout(4, bad)


def test_degree_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"degree must be an int, got '2' \(str\)"):
        check_layout(4, "2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate_degree must be an int, got True \(bool\)"):
        check_layout(4, 2, True)


def test_init_mesh_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_mesh needs an initialised default process group"):
        init_mesh(1, device_type="cpu")
