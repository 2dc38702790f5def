"""``update_biases_after_each_step`` (one process): the ``"balanced"`` bias moves by the counts of the
optimizer step it belongs to, also when the step's forward and backward run inside ``step(closure)``
as under Lightning's automatic optimization. Through the Trainer: ``tests/trainer/test_resume.py``."""

from __future__ import annotations

import torch
from conftest import tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.parallel.balance import update_biases_after_each_step

RATE = 0.01


def _balanced_model():
    return lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="balanced", balance_update_rate=RATE))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _expected(bias: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    return bias + RATE * torch.sign(load.mean() - load)


def test_step_with_a_closure_uses_the_closures_counts() -> None:
    model = _balanced_model()
    layers = lightning_ep.moe_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handles = update_biases_after_each_step([optimizer], model)
    for step in range(3):
        before = [layer.gate.expert_bias.clone() for layer in layers]
        counts: list[list[torch.Tensor]] = []

        def closure(seed: int = step, counts: list = counts) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(input_ids=_tokens(seed), labels=_tokens(seed)).loss
            loss.backward()
            counts.append([layer.tokens_per_expert.float() for layer in layers])
            return loss

        optimizer.step(closure)
        for i, layer in enumerate(layers):
            assert torch.equal(layer.gate.expert_bias, _expected(before[i], counts[0][i]))
            assert torch.count_nonzero(layer.gate.pending_load) == 0
    assert torch.count_nonzero(layers[0].gate.expert_bias) > 0
    for handle in handles:
        handle.remove()
    model(input_ids=_tokens(9))
    optimizer.step()
    assert torch.count_nonzero(layers[0].gate.pending_load) > 0  # detached: no update any more


def test_a_closure_evaluated_twice_updates_once_with_both_counts() -> None:
    """LBFGS evaluates its closure several times per step: one update, all of the step's counts."""
    model = _balanced_model()
    layer = lightning_ep.moe_layers(model)[0]
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.0, max_iter=2)
    update_biases_after_each_step([optimizer], model)
    counts = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(input_ids=_tokens(len(counts)), labels=_tokens(len(counts))).loss
        loss.backward()
        counts.append(layer.tokens_per_expert.float())
        return loss

    optimizer.step(closure)
    assert len(counts) >= 2
    assert torch.equal(layer.gate.expert_bias, _expected(torch.zeros(8), sum(counts)))
