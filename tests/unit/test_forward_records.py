"""``routing.rng.ForwardRecords``: what a training forward records, its recomputation recalls once;
the oldest records of forwards never recomputed are dropped past the limit."""

from __future__ import annotations

from lightning_ep.moe.routing.rng import ForwardRecords


def test_record_recall_and_limit() -> None:
    records: ForwardRecords[str | None] = ForwardRecords(limit=2)
    assert not records and len(records) == 0
    assert records.record(0, "a") == "a"
    records.record(1, "b")
    records.record(2, "c")  # past the limit: forward 0 was never recomputed
    assert len(records) == 2
    assert records.recall(0, None) is None
    assert records.recall(2, None) == "c"
    assert records.recall(2, None) is None, "a record is recalled once"
    assert records.recall(1, "x") == "b" and not records
