"""``MoELayer.keep_all_to_all`` on 2 gloo processes: activation checkpointing that keeps the dispatch
plan and the exchanged rows recomputes each layer without any forward exchange or host sync, with
bitwise the results of recomputing them (see ``recompute_workers.run_keep_all_to_all``), also in
families whose shared experts overlap the dispatch."""

from __future__ import annotations

import pytest
from harness import spawn
from recompute_workers import run_keep_all_to_all

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("shuffle", [False, True], ids=["plain", "token-shuffle"])
def test_keep_all_to_all_replays_the_exchanges(shuffle: bool) -> None:
    spawn(run_keep_all_to_all, 2, shuffle)


def test_keep_all_to_all_replays_deduplicated_exchanges() -> None:
    spawn(run_keep_all_to_all, 2, False, "cpu", "mixtral", True)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_keep_all_to_all_with_shared_experts(model_type: str) -> None:
    spawn(run_keep_all_to_all, 2, False, "cpu", model_type)
