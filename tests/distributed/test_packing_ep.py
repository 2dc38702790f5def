"""A packed row is its documents at expert-parallel degree 2 on 2 gloo processes (DESIGN.md, invariant 11).

Each rank trains on its own row from transformers' ``DataCollatorWithFlattening`` (24 and 31 tokens)
through ``transform(mesh=...)`` and ``shard_model``, what ``ExpertParallelStrategy`` runs, with
``config.use_cache`` on: loss and every full gradient equal data parallelism of the documents each alone
on the untouched model, and of the documents as one padded batch per rank with the router losses on,
whose token counts and aux and z losses each rank matches (``packing_workers.check_packing_degree2``),
for every supported family, eagerly and with the strategy's compiled layers (``aot_eager``: the same
graphs without inductor's code generation, in the forked workers). And
``ExpertParallelStrategy(2)`` itself in a Trainer on the two processes, against the documents each
alone. The one-process twin, inductor included, is ``tests/unit/test_packing.py``.
"""

from __future__ import annotations

import pytest
from harness import free_port, spawn
from packing_workers import FAMILIES, check_strategy_degree2, run_packing

pytestmark = pytest.mark.distributed


def test_packed_rows_at_degree_2() -> None:
    spawn(run_packing, 2, list(FAMILIES), False)


def test_packed_rows_at_degree_2_with_compiled_layers() -> None:
    spawn(run_packing, 2, list(FAMILIES), True)


def test_packed_rows_through_the_strategy_at_degree_2() -> None:
    spawn(check_strategy_degree2, 2, free_port())
