"""``RowBudget``'s automatic sizing and its non-raising read, and the padded all-to-all's index maps
(``padded_plan``) on a hand-worked example."""

from __future__ import annotations

import torch

from lightning_ep.moe.dispatch.static.budget import HEADROOM, RowBudget
from lightning_ep.moe.dispatch.static.padded import padded_plan, pair_loads


def test_an_automatic_budget_is_sized_grown_and_read_without_raising() -> None:
    budget = RowBudget(None, adaptive=True, multiple=3)
    assert budget.take_excess() is None  # nothing noted, not sized
    assert budget.fit([40, 10]) == 72  # ceil(40 x 1.25) = 50, rounded up to a multiple of lcm(8, 3) = 24
    assert HEADROOM == 1.25
    budget.note(torch.tensor([30, 70]))
    budget.check(wait=True)  # 70 <= 72: nothing to raise, and the note stays
    budget.note(torch.tensor([90, 10]))
    assert budget.take_excess() == [90, 70]  # the running maximum per rank
    assert budget.take_excess() is None  # read once
    assert budget.grow([90, 70]) and budget.budget == 120  # ceil(112.5) = 113 -> 120
    forced = RowBudget(100, multiple=8)
    assert forced.budget == 104 and not forced.grow([500]) and forced.budget == 104


def test_padded_plan_index_maps() -> None:
    """Two ranks, two experts each (E = 4), 3 slots per destination, seen from rank 0.

    Rank 0's sorted pairs: experts [0, 0, 1, 2, 3, 3, 3, 3] -> 3 pairs for rank 0, 5 for rank 1 (2 over).
    Rank 1 sends rank 0: 1 pair for expert 0 and 1 for expert 1."""
    counts_DE = torch.tensor([[2, 1, 1, 4], [1, 1, 3, 0]])
    plan = padded_plan(counts_DE, rank=0, num_local=2, slots=3, pairs=8)
    assert plan.slot_N.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert plan.send_S.tolist() == [0, 1, 2, 3, 4, 5]
    # Received: slots 0-2 from rank 0 (experts 0, 0, 1), slots 3-5 from rank 1 (experts 0, 1, padding).
    # Expert-major: expert 0 from rank 0 (slots 0, 1), from rank 1 (slot 3); expert 1 (slots 2, 4); padding.
    assert plan.regroup_M.tolist() == [0, 1, 3, 2, 4, -1]
    assert plan.unregroup_S.tolist() == [0, 1, 3, 2, 4, -1]
    assert plan.counts_L.tolist() == [3, 2]
    # Pair loads: rank 0 gets 3 from itself and 2 from rank 1; rank 1 gets 5 from rank 0 and 3 from itself.
    assert pair_loads(counts_DE, 2).tolist() == [6, 10] == plan.loads_D.tolist()
