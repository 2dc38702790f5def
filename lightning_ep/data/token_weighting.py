"""The token-weighted objective: each optimizer step minimises the sum of the per-token losses over
all of the step's labelled tokens, across its gradient-accumulation micro-batches and data-parallel
ranks, divided by their count.

Legend: A micro-batches per optimizer step (``accumulate_grad_batches``), W data-parallel ranks,
``s_rm`` the summed cross-entropy of rank ``r``'s micro-batch ``m`` over its ``n_rm`` labelled
tokens, N the step's labelled tokens (the sum of ``n_rm``).

A per-micro-batch mean loss (Hugging Face's default) gives the step ``1/(A W) * sum_rm s_rm / n_rm``:
a micro-batch with 3 labelled tokens counts as much as one with 300 (assistant-only labels, packed
rows). The token-weighted step is ``sum_rm s_rm / N``, as transformers' ``Trainer`` computes from
``num_items_in_batch``.

``token_weighted`` reads a step's ``A`` micro-batches ahead, counts their labelled tokens
(``count_loss_tokens``), all-reduces the count over the data-parallel group, and gives each batch
``num_items_in_batch = N / (A W)``. A Hugging Face causal LM called with ``model(**batch)`` then
returns ``s_rm * A * W / N``, and Lightning's division by ``accumulate_grad_batches`` and FSDP2's
mean over the ``W`` ranks leave exactly ``sum_rm s_rm / N``; the training step stays
``return self.model(**batch).loss``. ``TokenWeightedDataLoader`` does this as a ``DataLoader``.

Only the model's returned loss is token-weighted: the MoE aux and z losses keep their scale (``coeff``
times their mean over the step's micro-batches and ranks, ``MoELayer.loss_scale``). ``A`` must be the
Trainer's ``accumulate_grad_batches``: another value scales the step's loss by their ratio.

Cost: ``A`` batches held on the host ahead of their step, one sum over each batch's labels, and one
all-reduce of one integer per optimizer step (on the host under gloo, on the GPU under NCCL).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

#: The label value that Hugging Face losses skip.
IGNORE_INDEX = -100
#: The batch key that Hugging Face models pass on to their loss as its divisor.
KEY = "num_items_in_batch"


def count_loss_tokens(batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The number of positions a Hugging Face causal-LM loss averages over in ``batch``, as an int64
    0-dim tensor on the labels' device. The model shifts ``labels [B, S]`` left by one, so the count is
    that of ``labels[..., 1:] != ignore_index``; ``shift_labels`` (already shifted, as under context
    parallelism) are counted as they are. Padding and a packed row's document starts carry
    ``ignore_index`` and are not counted. ``TypeError`` for a batch that is not a mapping,
    ``ValueError`` for one without ``labels`` or ``shift_labels``.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"count_loss_tokens(batch=...) needs a mapping with 'labels' (a dict batch), got {type(batch).__name__}."
        )
    if batch.get("shift_labels") is not None:
        return (torch.as_tensor(batch["shift_labels"]) != ignore_index).sum()
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(
            f"count_loss_tokens: the batch has no 'labels' (keys: {sorted(batch)}); the token-weighted "
            "objective counts the labelled tokens, so give every training batch its labels "
            f"({ignore_index} where there is no target)."
        )
    return (torch.as_tensor(labels)[..., 1:] != ignore_index).sum()


def token_weighted(
    batches: Iterable[Mapping[str, Any]],
    accumulate_grad_batches: int,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Iterator[dict[str, Any]]:
    """The batches of ``batches``, each with ``num_items_in_batch = N / (A W)`` for its step's ``N``.

    Consecutive groups of ``accumulate_grad_batches`` batches form the optimizer steps, as Lightning
    groups them from the start of each epoch; a shorter last group is counted over the batches it
    has. A step without a labelled token gets ``N = 1``: its loss is 0, not NaN.

    Args:
        batches: dict batches holding ``labels`` (or ``shift_labels``), e.g. a ``DataLoader``'s.
        accumulate_grad_batches: ``A``: the Trainer's ``accumulate_grad_batches`` (under manual
            optimization, what the loss is divided by before ``manual_backward``).
        group: the data-parallel group whose ranks average the gradients; ``None``: the default group
            (every rank under ``ExpertParallelStrategy``), or one process. Every rank of it must yield
            the same number of batches (a ``DistributedSampler`` does): each step's count is all-reduced.
    Yields:
        A new dict per batch with ``num_items_in_batch``: float32, 0-dim, on the all-reduce's device.
    Raises:
        ValueError, TypeError: a bad ``accumulate_grad_batches`` (at the call); while iterating, a batch
            that is not a mapping, has no labels or already holds ``num_items_in_batch``.
    """
    _check_accumulate(accumulate_grad_batches)
    return _with_step_counts(iter(batches), accumulate_grad_batches, group, ignore_index)


def _with_step_counts(
    iterator: Iterator[Mapping[str, Any]], accumulate: int, group: dist.ProcessGroup | None, ignore_index: int
) -> Iterator[dict[str, Any]]:
    distributed = dist.is_available() and dist.is_initialized()
    ranks = dist.get_world_size(group) if distributed else 1
    device = torch.device("cpu")  # where the all-reduce takes its tensor: the current GPU under NCCL
    if distributed and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    while step := list(islice(iterator, accumulate)):
        if any(isinstance(batch, Mapping) and KEY in batch for batch in step):
            raise ValueError(
                f"token_weighted: a batch already holds {KEY!r}; it sets that key itself. Leave it out of "
                "the collate function, or drop the token-weighted loader."
            )
        count = sum(
            (count_loss_tokens(b, ignore_index=ignore_index).to(device) for b in step),
            torch.zeros((), dtype=torch.int64, device=device),
        )
        if ranks > 1:
            dist.all_reduce(count, group=group)
        # float64 for the quotient, float32 for the loss: the divisor of an fp32 loss stays fp32.
        divisor = (count.clamp(min=1).double() / (accumulate * ranks)).float()
        for batch in step:
            yield {**batch, KEY: divisor}


def _check_accumulate(accumulate_grad_batches: Any) -> None:
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise TypeError(f"token_weighted(accumulate_grad_batches={accumulate_grad_batches!r}) must be an int.")
    if accumulate_grad_batches < 1:
        raise ValueError(
            f"token_weighted(accumulate_grad_batches={accumulate_grad_batches}) must be >= 1: the micro-batches "
            "per optimizer step (the Trainer's accumulate_grad_batches)."
        )


class TokenWeightedDataLoader(DataLoader):
    """A ``DataLoader`` whose batches carry ``num_items_in_batch`` for the token-weighted objective
    (``token_weighted``; its collate function must give dict batches with ``labels``). Lightning gives
    it its distributed sampler, worker seeding and epoch setting as any other; its length is the number
    of micro-batches. Build it in ``train_dataloader`` with the Trainer's ``accumulate_grad_batches``
    (``group``, ``ignore_index``: as for ``token_weighted``; other arguments go to ``DataLoader``).
    """

    def __init__(
        self,
        dataset: Dataset,
        accumulate_grad_batches: int = 1,
        group: dist.ProcessGroup | None = None,
        ignore_index: int = IGNORE_INDEX,
        **kwargs: Any,
    ) -> None:
        _check_accumulate(accumulate_grad_batches)
        super().__init__(dataset, **kwargs)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.group = group
        self.ignore_index = ignore_index

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        return token_weighted(
            super().__iter__(), self.accumulate_grad_batches, group=self.group, ignore_index=self.ignore_index
        )
