"""Padding and tracing on CUDA, bf16, one GPU: the fused kernels (grouped GEMMs, SwiGLU, combine) see only
real tokens, so the content of padded positions changes nothing, bitwise; a whole model compiled with
``fullgraph=True`` (inductor) gives the eager results; compiled routing follows changing token counts.

The CPU twins are ``tests/unit/test_padding.py`` and ``tests/unit/test_hf_compat.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err

import lightning_ep
from lightning_ep import LayerExecution, MoEConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(execution: LayerExecution | None = None, **moe: object) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    model = MixtralForCausalLM(config)
    moe_config = MoEConfig(**moe)  # type: ignore[arg-type]
    return lightning_ep.transform(model, moe_config, execution=execution).to("cuda", torch.bfloat16).train()


def _batch(pad_seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 48), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((48, 40, 17, 30)):
        mask[row, length:] = 0
    if pad_seed is not None:
        fill = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(pad_seed))
        ids = torch.where(mask.bool(), ids, fill)
    labels = torch.where(mask.bool(), ids, -100)
    return {k: v.cuda() for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


@pytest.mark.parametrize(
    "moe",
    [
        {"moe_load_balancing": "sinkhorn"},
        {"moe_load_balancing": "aux_loss", "capacity_factor": 0.5, "drop_policy": "position"},
        {"moe_load_balancing": "balanced", "capacity_factor": 0.5},
        {"moe_load_balancing": "none", "execution": LayerExecution(cuda_graphs=True)},
    ],
    ids=["sinkhorn", "aux-capacity-position", "balanced-capacity", "graphs"],
)
def test_pad_content_changes_nothing_on_cuda(moe: dict) -> None:
    base = _model(**moe)
    results = []
    for pad_seed in (None, 5):
        model = copy.deepcopy(base)
        for _ in range(3):  # with cuda_graphs the third call would capture (the padded shapes fall back)
            model.zero_grad(set_to_none=True)
            out = model(**_batch(pad_seed))
            out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        counts = [layer.tokens_per_expert.clone() for layer in lightning_ep.moe_layers(model)]
        results.append((out.loss.detach(), grads, counts))
    (loss_a, grads_a, counts_a), (loss_b, grads_b, counts_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    real_pairs = int(_batch(None)["attention_mask"].sum()) * 2
    assert all(torch.equal(a, b) and int(a.sum()) == real_pairs for a, b in zip(counts_a, counts_b, strict=True))


def test_compiled_routing_follows_changing_token_counts() -> None:
    """``compile_routing`` (what ``Execution(compile=True)`` compiles in each MoE layer) on padded batches whose
    number of real tokens changes from call to call gives the eager routing's losses and gradients."""
    torch._dynamo.reset()
    eager = _model(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01)
    compiled = copy.deepcopy(eager)
    for layer in lightning_ep.moe_layers(compiled):
        layer.compile_routing()
    for cut in (48, 33, 20, 41):
        batch = _batch(None)
        batch["attention_mask"][:, cut:] = 0
        batch["labels"][:, cut:] = -100
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.detach().float())
        assert rel_err(losses[1], losses[0]) < 1e-3, cut
        for a, b in zip(lightning_ep.moe_layers(eager), lightning_ep.moe_layers(compiled), strict=True):
            assert torch.equal(a.tokens_per_expert, b.tokens_per_expert), cut
            assert rel_err(b.gate.weight.grad.float(), a.gate.weight.grad.float()) < 2e-2, cut


def test_whole_model_compiled_fullgraph_on_cuda() -> None:
    """``torch.compile(model, fullgraph=True)`` (inductor) traces through the MoE layers on one GPU, padded
    batch included: logits equal eager to bf16 rounding; padded rows keep their shapes in the graph."""
    torch._dynamo.reset()
    model = _model(moe_load_balancing="none").eval()
    batch = _batch(None)
    del batch["labels"]
    with torch.no_grad():
        eager = model(**batch, use_cache=False).logits.float()
        compiled = torch.compile(model, fullgraph=True)(**batch, use_cache=False).logits.float()
    real = batch["attention_mask"].bool()
    assert rel_err(compiled[real], eager[real]) < 2e-2
