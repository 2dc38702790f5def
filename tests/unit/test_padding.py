"""Padding is not data: with an ``attention_mask``, padded positions take no part in routing, losses,
counts, Sinkhorn, capacity or ``"balanced"``'s counts, and their content changes nothing, on one
process, eagerly and in a traced graph (``torch.compile``, ``torch.export``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.routing.losses import load_balancing_loss, z_loss
from lightning_ep.moe.routing.router import sinkhorn_log
from lightning_ep.moe.tokens import TokenBatch
from lightning_ep.parallel.balance import update_expert_biases

MODES = ["sinkhorn", "aux_loss", "balanced", "none"]
DISPATCH = [
    {},
    {"capacity_factor": 0.5, "drop_policy": "probs"},
    {"capacity_factor": 0.5, "drop_policy": "position"},
]
DISPATCH_IDS = ["dropless", "capacity-probs", "capacity-position"]


def padded_batch(pad_seed: int | None) -> dict[str, torch.Tensor]:
    """Three sequences of 12 (right-padded to 9 and 5 real tokens, one left-padded by 3); the padded
    positions hold token 0, or random tokens drawn from ``pad_seed``."""
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 9:] = 0
    mask[1, 5:] = 0
    mask[2, :3] = 0
    fill = torch.zeros_like(ids)
    if pad_seed is not None:
        fill = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(pad_seed))
    ids = torch.where(mask.bool(), ids, fill)
    labels = torch.where(mask.bool(), ids, -100)
    # Under left padding the first real token is predicted from a padded position: not a real label.
    labels[2, 3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, object]:
    out = model(**batch)
    out.loss.backward()
    layers = lightning_ep.moe_layers(model)
    pending = [layer.gate.pending_load.clone() for layer in layers if layer.gate.mode == "balanced"]
    update_expert_biases(model)
    return {
        "loss": out.loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "counts": [layer.tokens_per_expert.clone() for layer in layers],
        "aux": [layer.aux_loss.clone() for layer in layers],
        "z": [layer.z_loss.clone() for layer in layers],
        "entropy": [layer.router_entropy.clone() for layer in layers],
        "dropped": [layer.tokens_dropped.clone() for layer in layers],
        "pending": pending,
        "biases": [b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")],
    }


def _assert_bitwise(a: dict, b: dict) -> None:
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    for key in ("counts", "aux", "z", "entropy", "dropped", "pending", "biases"):
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key


@pytest.mark.parametrize("dispatch", DISPATCH, ids=DISPATCH_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_pad_content_changes_nothing(mode: str, dispatch: dict) -> None:
    """Two batches that differ only in the content of padded positions give bitwise-equal loss,
    gradients, counts, losses, dropped counts and ``"balanced"`` bias updates."""
    base = tiny_mixtral()
    config = MoEConfig(moe_load_balancing=mode, moe_aux_loss_coeff=0.01, **dispatch)  # type: ignore[arg-type]
    runs = [_run(lightning_ep.transform(copy.deepcopy(base), config), padded_batch(seed)) for seed in (None, 1)]
    _assert_bitwise(*runs)
    real_pairs = int(padded_batch(None)["attention_mask"].sum()) * 2
    assert all(int(c.sum()) == real_pairs for c in runs[0]["counts"])  # pads are not counted
    if dispatch:
        assert sum(int(d) for d in runs[0]["dropped"]) > 0  # the capacity binds: the comparison is not vacuous
    if mode == "balanced":
        assert all(int(p.sum()) <= real_pairs for p in runs[0]["pending"])


@pytest.mark.parametrize("order", ["peft-then-transform", "transform-then-peft"])
def test_peft_model_leaves_padding_out(order: str) -> None:
    """A PEFT-wrapped model (LoRA on the attention and the experts), transformed before or after
    wrapping: the pads' content changes nothing, and only real tokens are counted."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], target_parameters=["gate_up_proj", "down_proj"])
    config = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01)

    def build() -> torch.nn.Module:
        if order == "transform-then-peft":
            return get_peft_model(lightning_ep.transform(tiny_mixtral(), config), lora)
        return lightning_ep.transform(get_peft_model(tiny_mixtral(), lora), config)

    runs = [_run(build(), padded_batch(seed)) for seed in (None, 1)]
    _assert_bitwise(*runs)
    assert any("lora" in name for name in runs[0]["grads"])
    real_pairs = int(padded_batch(None)["attention_mask"].sum()) * 2
    assert all(int(c.sum()) == real_pairs for c in runs[0]["counts"])


def _layer_inputs(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    inputs: list[torch.Tensor] = []
    handles = [
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone()))
        for layer in lightning_ep.moe_layers(model)
    ]
    return inputs, handles


@pytest.mark.parametrize("mode", ["aux_loss", "none", "balanced"])
def test_losses_and_counts_are_those_of_the_real_tokens(mode: str) -> None:
    """Each layer's aux loss (Megatron-Core's formula), z-loss, entropy and counts equal a hand
    computation on the real tokens' rows alone; outputs at padded positions are zero."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing=mode))
    batch = padded_batch(None)
    inputs, handles = _layer_inputs(model)
    outputs: list[torch.Tensor] = []
    handles += [
        layer.register_forward_hook(lambda _m, _a, out: outputs.append(out.detach()))
        for layer in lightning_ep.moe_layers(model)
    ]
    model(**batch)
    for h in handles:
        h.remove()
    real = batch["attention_mask"].reshape(-1).bool()
    for layer, x_BSH, y_BSH in zip(lightning_ep.moe_layers(model), inputs, outputs, strict=True):
        x_NH = x_BSH.reshape(-1, x_BSH.shape[-1])[real]
        logits = x_NH @ layer.gate.weight.detach().t()
        probs = torch.softmax(logits, dim=-1)
        ids = torch.topk(probs, layer.top_k, dim=-1).indices
        assert rel_err(layer.aux_loss, load_balancing_loss(probs, ids)) < 1e-6
        assert rel_err(layer.z_loss, z_loss(logits)) < 1e-6
        entropy = -(probs * probs.log()).sum(-1).mean()
        assert rel_err(layer.router_entropy, entropy) < 1e-5
        assert torch.equal(layer.tokens_per_expert, torch.bincount(ids.reshape(-1), minlength=layer.num_experts))
        assert torch.all(y_BSH.reshape(-1, y_BSH.shape[-1])[~real] == 0)


def test_without_a_mask_every_token_counts() -> None:
    """The same batch without its ``attention_mask`` routes every position: the pads are data then."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none"))
    batch = padded_batch(None)
    model(input_ids=batch["input_ids"])
    assert all(int(layer.tokens_per_expert.sum()) == 36 * 2 for layer in lightning_ep.moe_layers(model))
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert all(int(layer.tokens_per_expert.sum()) == 23 * 2 for layer in lightning_ep.moe_layers(model))
    # After the call the layers hold no mask: a direct call routes every row.
    layer = lightning_ep.moe_layers(model)[0]
    assert layer.token_batch is None
    layer(torch.randn(2, 5, 64))
    assert int(layer.tokens_per_expert.sum()) == 10 * 2


def test_sinkhorn_leaves_padded_rows_out_of_the_normalisation() -> None:
    """Sinkhorn with ``valid_T`` gives the real rows the scores it gives them alone."""
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    valid = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    masked = sinkhorn_log(logits, 30, valid)
    alone = sinkhorn_log(logits[valid], 30)
    assert torch.allclose(masked[valid], alone, rtol=0, atol=1e-12)
    assert torch.all(masked[~valid] == float("-inf"))
    assert torch.allclose(masked[valid].exp().sum(0), torch.full((4,), 6 / 4, dtype=torch.float64))


def test_mask_shape_must_match_the_tokens() -> None:
    layer = lightning_ep.moe_layers(lightning_ep.transform(tiny_mixtral(), MoEConfig()))[0]
    layer.token_batch = TokenBatch(torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"the attention_mask of this call has shape \[2, 7\], but a MoE layer got"):
        layer(torch.randn(3, 7, 64))


def test_generation_with_a_cache_takes_the_masks_last_positions() -> None:
    """With a KV cache the mask covers past and current positions, the layer sees the current ones:
    greedy generation of a left-padded batch equals that of each prompt alone."""
    reference = tiny_mixtral().eval()
    model = lightning_ep.transform(copy.deepcopy(reference), MoEConfig(moe_load_balancing="none")).eval()
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 4)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, 7 - prompt.shape[1] :] = prompt
        mask[row, 7 - prompt.shape[1] :] = 1
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    batched = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    for row, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        assert torch.equal(batched[row, 7:], alone[0, prompt.shape[1] :]), row
        assert torch.equal(
            alone, reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        )


@pytest.mark.parametrize("dispatch", DISPATCH, ids=DISPATCH_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_traced_padding_equals_eager(mode: str, dispatch: dict) -> None:
    """Traced by ``torch.compile(fullgraph=True)``, a layer keeps its shapes (padded rows zeroed,
    spread over the experts with weight 0, masked out of every statistic) instead of leaving the
    padding out: the same outputs, losses, counts and drops as eagerly."""
    torch._dynamo.reset()  # each case compiles anew; the cases together would pass Dynamo's recompile limit
    torch.manual_seed(0)
    config = MoEConfig(moe_load_balancing=mode, **dispatch)  # type: ignore[arg-type]
    layers = [lightning_ep.moe_layers(lightning_ep.transform(tiny_mixtral(), config))[0] for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 12, 64)
    mask = padded_batch(None)["attention_mask"]
    results = []
    for layer, run in zip(
        layers, (layers[0], torch.compile(layers[1], backend="aot_eager", fullgraph=True)), strict=True
    ):
        layer.token_batch = TokenBatch(mask)
        xi = x.clone().requires_grad_(True)
        y = run(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad, layer))
    (y0, gx0, gg0, ge0, l0), (y1, gx1, gg1, ge1, l1) = results
    assert rel_err(y1, y0) < 1e-6 and rel_err(gx1, gx0) < 1e-6
    assert rel_err(gg1, gg0) < 1e-5 and rel_err(ge1, ge0) < 1e-5
    assert torch.all(y1.reshape(-1, 64)[~mask.reshape(-1).bool()] == 0)
    assert rel_err(l1.aux_loss, l0.aux_loss) < 1e-6 and rel_err(l1.z_loss, l0.z_loss) < 1e-6
    assert torch.equal(l1.tokens_per_expert, l0.tokens_per_expert)
    assert torch.equal(l1.tokens_dropped, l0.tokens_dropped)
    if mode == "balanced":
        assert torch.equal(l1.gate.pending_load, l0.gate.pending_load)


def test_exported_model_leaves_padding_out() -> None:
    """``torch.export`` on one process: the exported program gives the eager logits, with and without
    padding in the batch it runs on."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none")).eval()
    batch = padded_batch(None)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    program = torch.export.export(model, (), inputs)
    for mask in (batch["attention_mask"], torch.ones_like(batch["attention_mask"])):
        run = {**inputs, "attention_mask": mask}
        assert rel_err(program.module()(**run).logits, model(**run).logits) < 1e-6


def test_layer_without_tokens_is_finite() -> None:
    """A call whose tokens are all padding routes nothing: zero output, zero losses, no NaN."""
    layer: MoELayer = lightning_ep.moe_layers(lightning_ep.transform(tiny_mixtral(), MoEConfig(capacity_factor=1.0)))[0]
    layer.token_batch = TokenBatch(torch.zeros(2, 5, dtype=torch.long))
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert torch.all(y == 0) and torch.all(x.grad == 0)
    assert layer.aux_loss.item() == 0 and layer.z_loss.item() == 0 and int(layer.tokens_per_expert.sum()) == 0


def test_router_jitter_refuses_a_traced_training_forward() -> None:
    """Router jitter draws from per-step seeded streams that a traced graph cannot replay: a clear error."""
    torch._dynamo.reset()
    model = lightning_ep.transform(tiny_mixtral(router_jitter_noise=0.1), MoEConfig(moe_load_balancing="none"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"router jitter \(router_jitter_noise=0.1\) draws from lightning_ep's seeded"):
        compiled(input_ids=torch.randint(0, 128, (2, 8)))
    model.eval()
    compiled(input_ids=torch.randint(0, 128, (2, 8)))  # no jitter in eval: traces


def test_monitor_statistics_leave_out_padding() -> None:
    """``MoEMonitor``'s window (``MoELoadMetric`` fed the layers' values, as the callback does) counts the
    real tokens only: a padded call and the same call with its padding cut off give the same counts,
    dead experts and dropped fraction."""
    from lightning_ep.monitor.callback import MoELoadMetric

    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none", capacity_factor=0.5)).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    padded = {"input_ids": torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], 1)}
    padded["attention_mask"] = torch.cat([torch.ones(1, 12), torch.zeros(1, 6)], 1).long()
    windows = []
    for batch in (padded, {"input_ids": ids}):
        model(**batch)
        layers = lightning_ep.moe_layers(model)
        metric = MoELoadMetric(len(layers), 8, 2)
        metric.update(
            torch.stack([layer.tokens_per_expert for layer in layers]),
            torch.stack([layer.router_entropy for layer in layers]),
            torch.stack([layer.aux_loss for layer in layers]),
            torch.stack([layer.z_loss for layer in layers]),
            torch.stack([layer.tokens_dropped for layer in layers]),
        )
        windows.append(metric.compute())
    assert windows[0]["moe_tokens"].item() == 2 * 12
    assert torch.equal(windows[0]["tokens_per_expert"], windows[1]["tokens_per_expert"])
    for name in ("dead_experts", "tokens_dropped_frac", "load_imbalance"):
        assert torch.allclose(windows[0]["model"][name], windows[1]["model"][name]), name
