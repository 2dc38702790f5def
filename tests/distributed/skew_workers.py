"""Worker bodies for the skewed-routing tests (every token routed to expert 0, on EP rank 0)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.routing.router import Routing

T, H, WIDTH, K, E = 32, 64, 32, 1, 8  # tokens per rank, hidden, expert width, top-k, experts


def _all_to_expert_zero(gate, _inputs, routing: Routing) -> Routing:
    ids_TK = torch.zeros_like(routing.expert_ids_TK)
    return Routing(routing.logits_TE, routing.probs_TE, ids_TK, torch.ones_like(routing.weights_TK))


def moe_layer(config: MoEConfig, degree: int, top_k: int = K):
    """The MoE layer of a one-layer tiny Mixtral (seed 0), transformed at ``degree`` on the CPU, in
    training mode (also ``padded_workers.py``'s)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=128,
            hidden_size=H,
            intermediate_size=WIDTH,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=E,
            num_experts_per_tok=top_k,
        )
    )
    mesh = lightning_ep.init_mesh(degree, device_type="cpu")
    lightning_ep.transform(model, config, mesh=mesh)
    layer = lightning_ep.moe_layers(model)[0]
    layer.train()
    return layer


def _skewed_layer(config: MoEConfig, degree: int):
    layer = moe_layer(config, degree)
    layer.gate.register_forward_hook(_all_to_expert_zero)
    return layer


def saved_activation_bytes(fn, module: torch.nn.Module) -> tuple[torch.Tensor, int]:
    """Run ``fn()`` and count the bytes autograd keeps for backward (each storage once), weights excluded."""
    seen: dict[int, int] = {}
    weights = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in module.parameters()
    }

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0 and ptr not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def run_skew_survives(rank: int, world: int) -> None:
    """Dropless at degree ``world``: rank 0 takes every rank's tokens; forward and backward complete,
    and the activation memory kept on rank 0 stays within the README's bound."""
    layer = _skewed_layer(MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0), world)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out, saved = saved_activation_bytes(lambda: layer(x), layer)
    out.square().sum().backward()
    rows = world * T * K if rank == 0 else 0
    assert layer.tokens_per_expert.tolist() == [T * K] + [0] * (E - 1)
    grad = layer.experts.gate_up_proj.grad.to_local()
    assert torch.isfinite(grad).all() and (grad.abs().sum() > 0) == (rank == 0)
    # README: rows * (2 H + 3 I) * bytes for the experts and exchanged rows, plus O(T * (E + K + H)) for
    # routing and this rank's own tokens.
    bound = rows * (2 * H + 3 * WIDTH) * 4 + T * (4 * E + 4 * K + 3 * H) * 8
    assert saved <= bound, (rank, saved, bound)
    loads = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(loads, torch.tensor(saved))
    assert int(loads[0]) > 2 * max(int(v) for v in loads[1:]), loads  # the hot rank holds the hot rows


def run_budget_fails_fast(rank: int, world: int) -> None:
    import pytest

    budget = 2 * T * K  # rank 0 would receive world * T * K rows
    layer = _skewed_layer(MoEConfig(moe_load_balancing="none", max_tokens_per_rank=budget), world)
    message = (
        rf"MoE routing sent {world * T * K} rows to the experts of expert-parallel rank 0 in one layer, over "
        rf"MoEConfig.max_tokens_per_rank={budget} \(loads per rank: \[{world * T * K}, 0, 0, 0\]\)"
    )
    with pytest.raises(RuntimeError, match=message):
        layer(torch.randn(T, H))
    dist.barrier()  # every rank raised before any row moved: the group is still in step
