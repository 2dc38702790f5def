"""The token-weighted batches under NCCL on one GPU: the step's divisor lives on the GPU (where NCCL
all-reduces it), and every supported family's Hugging Face loss, called with the whole batch, is the
micro-batch's summed cross-entropy times ``A / N``, as on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ep.data import token_weighted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from families_workers import VOCAB, tiny_family

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def one_rank_nccl_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for labelled in (12, 2):  # targets per micro-batch (after the shift)
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        labels = torch.full_like(ids, -100)
        labels[0, 16 - labelled :] = ids[0, 16 - labelled :]
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss", "olmoe"])
def test_divisor_on_the_gpu_and_the_family_loss(one_rank_nccl_group, family: str) -> None:
    cuda = torch.device("cuda")
    batches = list(token_weighted(_batches(), 2))
    assert all(b["num_items_in_batch"].device.type == "cuda" for b in batches)
    assert float(batches[0]["num_items_in_batch"]) == 14 / 2
    model = tiny_family(family).to(cuda)
    expected = torch.zeros((), device=cuda)
    for batch in batches:
        logits = model(input_ids=batch["input_ids"].to(cuda)).logits.float()
        expected += F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten().to(cuda), reduction="sum", ignore_index=-100
        )
    losses = [model(**{k: v.to(cuda) for k, v in b.items()}).loss for b in batches]
    torch.testing.assert_close(sum(losses) / 2, expected / 14, rtol=1e-5, atol=0)
