"""Which parts of a LightningModule the strategy parallelises (``lightning_ep.strategy.model_selection``),
through the real Trainer on one process: two MoE models (a policy and a frozen reference), a value
head beside the model, and the refusals. The 4-rank equality with data parallelism of a value head
and a frozen model is ``tests/trainer/test_strategy.py::test_value_head_and_frozen_model_match_reference``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import rel_err, tiny_mixtral
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy, moe_layers
from lightning_ep.models.pretrained import from_pretrained

DATA = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))


class PolicyAndReference(LightningModule):
    """A DPO-like module: ``policy`` and ``reference`` MoE models, optionally a value head."""

    def __init__(self, build_policy, build_reference, head: bool = False, loose: bool = False) -> None:
        super().__init__()
        self.builders = (build_policy, build_reference)
        self.policy: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.head = nn.Linear(64, 1) if head else None
        self.scale = nn.Parameter(torch.ones(())) if loose else None
        self.steps = 0

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy, self.reference = self.builders[0](), self.builders[1]()

    def training_step(self, batch, batch_idx):
        self.steps += 1
        out = self.policy(input_ids=batch, labels=batch, output_hidden_states=True)
        with torch.no_grad():
            reference = self.reference(input_ids=batch).logits
        loss = out.loss + (out.logits - reference).pow(2).mean()
        return loss + self.head(out.hidden_states[-1]).pow(2).mean() if self.head is not None else loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _frozen():
    return tiny_mixtral(seed=1).requires_grad_(False)


def _fit(module: LightningModule, **strategy_args) -> None:
    strategy = ExpertParallelStrategy(1, process_group_backend="gloo", **strategy_args)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(DATA, batch_size=2))


def test_two_moe_models_need_moe_model(single_process) -> None:
    module = PolicyAndReference(tiny_mixtral, _frozen)
    message = (
        "ExpertParallelStrategy(moe_model=None): PolicyAndReference holds 2 MoE models, at ['policy', 'reference']; "
        "name the one to parallelise by its attribute path, e.g. ExpertParallelStrategy(moe_model='policy'). "
        "The others must be frozen (requires_grad_(False)): they stay whole on every rank."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _fit(module)
    assert module.steps == 0


def test_moe_model_that_names_no_moe_model(single_process) -> None:
    module = PolicyAndReference(tiny_mixtral, _frozen)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "ExpertParallelStrategy(moe_model='polcy'): PolicyAndReference has no MoE model at that attribute "
            "path; its MoE models are at ['policy', 'reference']."
        ),
    ):
        _fit(module, moe_model="polcy")


def test_a_trainable_second_moe_model_is_refused(single_process) -> None:
    module = PolicyAndReference(tiny_mixtral, lambda: tiny_mixtral(seed=1))
    with pytest.raises(
        ValueError,
        match=r"moe_model='policy'\): the other MoE model at 'reference' has \d+ trainable parameters, which would "
        r"train apart on each rank .*; freeze it in configure_model \(reference\.requires_grad_\(False\)\)",
    ):
        _fit(module, moe_model="policy")
    assert module.steps == 0


def test_a_parameter_beside_the_moe_model_is_refused(single_process) -> None:
    module = PolicyAndReference(tiny_mixtral, _frozen, loose=True)
    with pytest.raises(
        ValueError,
        match=re.escape("cannot shard the trainable parameters ['scale']: they sit directly on a module that also")
        + r".*Move them into a submodule whose forward uses them",
    ):
        _fit(module, moe_model="policy")


def test_policy_frozen_reference_and_value_head(single_process, tmp_path: Path) -> None:
    """Both models from ``from_pretrained`` folders (meta device): the policy is parallelised; the
    frozen reference keeps its own blocks and plain tensors, read whole from its folder; the value
    head is sharded with FSDP2 and trained."""
    tiny_mixtral(seed=0).save_pretrained(tmp_path / "policy")
    reference_weights = tiny_mixtral(seed=1)
    reference_weights.save_pretrained(tmp_path / "reference")
    module = PolicyAndReference(
        lambda: from_pretrained(tmp_path / "policy"),
        lambda: from_pretrained(tmp_path / "reference").requires_grad_(False),
        head=True,
    )
    head_before = module.head.weight.detach().clone()
    _fit(module, moe_model="policy")
    assert module.steps == 1
    assert moe_layers(module.policy) and not moe_layers(module.reference)
    assert not any(isinstance(p, DTensor) for p in module.reference.parameters())
    with torch.no_grad():
        expected = reference_weights.eval()(input_ids=DATA).logits
        got = module.reference.eval()(input_ids=DATA).logits
    assert rel_err(got, expected) < 1e-6
    assert isinstance(module.head.weight, DTensor)
    assert not torch.equal(module.head.weight.full_tensor(), head_before)  # it was trained
