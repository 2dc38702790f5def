"""The token-weighted objective on one process: the label count Hugging Face's loss uses, the
per-step grouping of ``token_weighted``, the loss a Hugging Face model returns with it, the
``DataLoader`` that Lightning rebuilds with its sampler, and the refusals.

The Trainer-level equality with the objective's definition (2 ranks, accumulation) is in
``tests/trainer/test_token_weighted.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mixtral

from lightning_ep.data import TokenWeightedDataLoader, count_loss_tokens, token_weighted


def _batch(labelled: list[tuple[int, int]], seq: int = 8) -> dict[str, torch.Tensor]:
    """Rows of ``seq`` tokens, row ``i`` labelled on positions ``[start, stop)``."""
    ids = torch.arange(len(labelled) * seq).reshape(len(labelled), seq) % 100
    labels = torch.full_like(ids, -100)
    for i, (start, stop) in enumerate(labelled):
        labels[i, start:stop] = ids[i, start:stop]
    return {"input_ids": ids, "labels": labels}


def test_count_is_of_the_shifted_labels() -> None:
    # Position 0's label is never a target (nothing predicts it); the others count.
    assert int(count_loss_tokens(_batch([(0, 8)]))) == 7
    assert int(count_loss_tokens(_batch([(0, 8), (5, 6), (0, 0)]))) == 8
    assert count_loss_tokens(_batch([(2, 4)])).dtype == torch.int64
    shifted = {"shift_labels": torch.tensor([[1, -100, 2]]), "labels": torch.tensor([[9, 9, 9]])}
    assert int(count_loss_tokens(shifted)) == 2  # already shifted: counted as it is
    assert int(count_loss_tokens({"labels": torch.tensor([[5, 0, 0]])}, ignore_index=0)) == 0


def test_a_packed_row_counts_its_documents_targets() -> None:
    from transformers import DataCollatorWithFlattening

    docs = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}]
    packed = DataCollatorWithFlattening(return_tensors="pt")(docs)
    # Each document's first label becomes -100: 2 targets in the first, 1 in the second.
    assert int(count_loss_tokens(packed)) == 3


def test_steps_get_their_count_over_accumulation_and_ranks() -> None:
    batches = [_batch([(0, 8)]), _batch([(6, 8)]), _batch([(1, 3), (4, 8)]), _batch([(0, 0)]), _batch([(3, 5)])]
    out = list(token_weighted(batches, 2))
    assert len(out) == 5
    # Steps: (7 + 2), (6 + 0), and a last one of a single batch (2), each over A * W = 2 * 1.
    assert [float(b["num_items_in_batch"]) for b in out] == [4.5, 4.5, 3.0, 3.0, 1.0]
    assert all(b["num_items_in_batch"].dtype == torch.float32 for b in out)
    assert torch.equal(out[2]["labels"], batches[2]["labels"]) and "num_items_in_batch" not in batches[2]
    # A step without any target: divisor 1 / A, so the loss is 0 rather than NaN.
    (empty,) = token_weighted([_batch([(0, 0)])], 2)
    assert float(empty["num_items_in_batch"]) == 0.5


def test_the_model_loss_is_the_micro_batch_sum_times_a_over_n() -> None:
    """``model(**batch).loss`` is ``sum / N * A * W``: Lightning's ``/A`` (and the mean over ``W``
    ranks) then leave ``sum / N`` for the step."""
    model = tiny_mixtral()
    batches = [_batch([(0, 8), (2, 5)]), _batch([(7, 8), (0, 0)])]
    total = torch.zeros(())
    for batch in batches:
        logits = model(input_ids=batch["input_ids"]).logits
        total = total + F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
    expected = total / 11  # 7 + 3 + 1 labelled targets
    losses = [model(**b).loss for b in token_weighted(batches, 2)]
    torch.testing.assert_close(sum(losses) / 2, expected, rtol=1e-6, atol=0)


def test_data_loader_batches_and_lightning_rebuild() -> None:
    """``TokenWeightedDataLoader`` yields dict batches with the key, and Lightning's sampler injection
    (``_update_dataloader``, as for a loader passed to ``Trainer.fit``) keeps its own arguments."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler

    rows = [{"input_ids": torch.arange(6), "labels": torch.arange(6) * (i % 2) - 100 * (1 - i % 2)} for i in range(8)]
    loader = TokenWeightedDataLoader(rows, batch_size=2, accumulate_grad_batches=2, ignore_index=-100)
    assert len(loader) == 4
    divisors = [float(b["num_items_in_batch"]) for b in loader]
    assert divisors == [5.0] * 4  # each step: 2 batches with one labelled row of 5 targets, / A = 2

    sampler = DistributedSampler(rows, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    assert isinstance(rebuilt, TokenWeightedDataLoader) and rebuilt.accumulate_grad_batches == 2
    assert rebuilt.sampler is sampler and len(rebuilt) == 2
    # Rank 1's rows 1, 3, 5, 7 are the labelled ones: one step of 2 batches with 10 targets each, / A = 2.
    assert [float(b["num_items_in_batch"]) for b in rebuilt] == [10.0, 10.0]


def test_refusals() -> None:
    with pytest.raises(ValueError, match=re.escape("token_weighted(accumulate_grad_batches=0) must be >= 1")):
        token_weighted([_batch([(0, 8)])], 0)  # at the call, not at the first batch
    with pytest.raises(TypeError, match=re.escape("token_weighted(accumulate_grad_batches=2.0) must be an int.")):
        token_weighted([_batch([(0, 8)])], 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("token_weighted(accumulate_grad_batches=0) must be >= 1")):
        TokenWeightedDataLoader([_batch([(0, 8)])], accumulate_grad_batches=0)
    with pytest.raises(
        ValueError, match=re.escape("count_loss_tokens: the batch has no 'labels' (keys: ['input_ids'])")
    ):
        list(token_weighted([{"input_ids": torch.zeros(1, 4)}], 1))
    with pytest.raises(TypeError, match=re.escape("count_loss_tokens(batch=...) needs a mapping with 'labels'")):
        list(token_weighted([torch.zeros(1, 4)], 1))  # type: ignore[list-item]
    with pytest.raises(ValueError, match=re.escape("token_weighted: a batch already holds 'num_items_in_batch'")):
        list(token_weighted([{**_batch([(0, 8)]), "num_items_in_batch": 3}], 1))
