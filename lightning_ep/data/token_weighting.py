"""The token-weighted objective: each optimizer step minimises the sum of the per-token losses over
all of the step's labelled tokens, across its gradient-accumulation micro-batches and data-parallel
ranks, divided by their count.

Legend: A micro-batches per optimizer step (``accumulate_grad_batches``), W data-parallel ranks,
``s_rm`` the summed cross-entropy of rank ``r``'s micro-batch ``m``, N the step's labelled tokens
(the sum of ``n_rm`` over ranks and micro-batches).

A loss that is each micro-batch's mean, as Hugging Face models return by default, gives the step
``1/(A W) * sum_rm s_rm / n_rm``: every micro-batch weighs the same, whatever its number of labelled
tokens (data parallelism's semantics). With assistant-only labels or packed rows, ``n_rm`` varies
widely, and a micro-batch with 3 labelled tokens then counts as much as one with 300. The
token-weighted step is ``sum_rm s_rm / N``, what transformers' ``Trainer`` computes from
``num_items_in_batch``.

The step's ``N`` must be known before its first backward. ``token_weighted`` reads the ``A``
micro-batches of a step ahead, counts their labelled tokens (``count_loss_tokens``), all-reduces the
count once per step over the data-parallel group, and gives each of those batches
``num_items_in_batch = N / (A W)``. A Hugging Face causal LM called with ``model(**batch)`` then
returns ``s_rm * A * W / N`` (its loss sums over the micro-batch's tokens and divides by
``num_items_in_batch``), and Lightning's division by ``accumulate_grad_batches`` and FSDP2's mean of
the gradients over the ``W`` ranks leave exactly ``sum_rm s_rm / N``. The training step stays
``return self.model(**batch).loss``. ``TokenWeightedDataLoader`` is a ``DataLoader`` that does this
to its batches, so that Lightning still gives it a distributed sampler.

Only the model's returned loss is token-weighted. The MoE aux and z losses reach the gradients inside
the MoE layers, per micro-batch and on each rank's own tokens, weighted ``coeff / A``
(``MoELayer.loss_scale``), and FSDP2 averages them over the ranks: they keep their scale, ``coeff``
times their mean over the step's micro-batches and ranks, as without token weighting. ``A`` must be
the Trainer's ``accumulate_grad_batches``: another value scales the step's loss by their ratio.

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
    """The number of positions a Hugging Face causal-LM loss averages over in ``batch``.

    The loss shifts ``labels [B, S]`` left by one inside the model (position ``t`` predicts label
    ``t + 1``), so the first label of each row is never a target: the count is that of
    ``labels[..., 1:] != ignore_index``. A batch that holds ``shift_labels`` (already shifted, as
    under context parallelism) is counted as it is. Padding and a packed row's document starts
    carry ``ignore_index`` (``DataCollatorWithFlattening`` puts it at each document's first label)
    and are not counted.

    Returns:
        An int64 0-dim tensor on the labels' device.
    Raises:
        TypeError: ``batch`` is not a mapping.
        ValueError: ``batch`` holds neither ``labels`` nor ``shift_labels``.
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
    groups them from the start of each epoch. A last group that is shorter (an epoch whose length is
    not a multiple of ``A``, where Lightning steps early but still divides by ``A``) is counted over
    the batches it has. A step without a labelled token gets ``N = 1``: its loss is 0, not NaN.

    Args:
        batches: dict batches holding ``labels`` (or ``shift_labels``), e.g. a ``DataLoader``'s.
        accumulate_grad_batches: ``A``, the micro-batches per optimizer step; under Lightning the
            Trainer's ``accumulate_grad_batches``. Under manual optimization: what the loss is
            divided by before ``manual_backward``.
        group: the data-parallel group whose ranks average the gradients; ``None``: every rank of
            the default group (as under ``ExpertParallelStrategy``, where every rank has its own
            data), or one process without ``torch.distributed``. Every rank of it must yield the same
            number of batches (a ``DistributedSampler`` does), since each step's count is all-reduced.
        ignore_index: the label value the loss skips.
    Yields:
        A new dict per batch: its items plus ``num_items_in_batch``, a float32 0-dim tensor (on the
        host under gloo, on this rank's GPU under NCCL).
    Raises:
        ValueError: ``accumulate_grad_batches`` below 1 (at the call); while iterating, a batch without
            labels or one that already holds ``num_items_in_batch``.
        TypeError: ``accumulate_grad_batches`` not an int (at the call); while iterating, a batch that
            is not a mapping.
    """
    _check_accumulate(accumulate_grad_batches)
    return _with_step_counts(iter(batches), accumulate_grad_batches, group, ignore_index)


def _with_step_counts(
    iterator: Iterator[Mapping[str, Any]], accumulate: int, group: dist.ProcessGroup | None, ignore_index: int
) -> Iterator[dict[str, Any]]:
    distributed = dist.is_available() and dist.is_initialized()
    ranks = dist.get_world_size(group) if distributed else 1
    device = _collective_device(group) if distributed else torch.device("cpu")
    while step := list(islice(iterator, accumulate)):
        for batch in step:
            if isinstance(batch, Mapping) and KEY in batch:
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
    """A ``torch.utils.data.DataLoader`` whose batches carry ``num_items_in_batch`` for the
    token-weighted objective (``token_weighted``, the module docstring).

    Takes ``DataLoader``'s arguments and three of its own. Being a ``DataLoader``, it gets
    Lightning's distributed sampler, worker seeding and epoch setting as any other; its length is
    the number of micro-batches. Build it in ``train_dataloader`` with the Trainer's
    ``accumulate_grad_batches``, and call the model with the whole batch (``self.model(**batch)``).

    Args:
        dataset: as for ``DataLoader``; its collate function must give dict batches with ``labels``.
        accumulate_grad_batches: the Trainer's ``accumulate_grad_batches``.
        group: the data-parallel group (``None``: the default group).
        ignore_index: the label value the loss skips.
        **kwargs: ``DataLoader``'s other arguments (``batch_size``, ``shuffle``, ``collate_fn``, ...).
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


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where an all-reduce over ``group`` takes its tensor: the current GPU under NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
