"""One MoE layer, forward + backward, beside torchtitan's MoE layer on the same shapes, one GPU.

torchtitan 0.3.0's ``models.common.moe.MoE`` (its ``TokenChoiceTopKRouter`` with softmax scores
and renormalised top-k weights, its ``LocalTokenDispatcher`` and its ``GroupedExperts`` on
``torch._grouped_mm``) against this library's ``MoELayer`` (router, local dispatch, grouped
experts) with ``moe_load_balancing="none"`` and no router losses, both in bf16 with the same
random weights; the expert floor (``18 * T * K * H * F`` at the grouped-GEMM rate measured now)
beside them. Rows in mirrored order (ours, torchtitan, torchtitan, ours); each row is the median
of ``--iters`` timed ``layer(x).backward(g)`` after ``--warmup`` untimed ones.

torchtitan is not a dependency: put its wheel and those of ``spmd_types``, ``tyro``,
``docstring_parser`` and ``typeguard`` on ``PYTHONPATH`` (``pip install --no-deps --target DIR``):

    PYTHONPATH=$PWD:DIR python benchmarks/bench_peer_layer.py --shapes fine coarse
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import SHAPES, Shape, add_record_args, grouped_gemm_fwd_bwd_ms, log, markdown_table, report
from bench_layer import build_layer, median_ms

from lightning_ep import MoEConfig


def torchtitan_layer(shape: Shape, ours: Any, device: torch.device) -> torch.nn.Module:
    """torchtitan's MoE at ``shape`` holding the very weights of ``ours`` (its ``w1``/``w3`` are the
    halves of our ``gate_up_proj``, ``w2`` our ``down_proj``)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts as TitanExperts
    from torchtitan.models.common.moe import MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    H, F, E, K = shape.hidden, shape.inter, shape.experts, shape.top_k
    config = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=TitanExperts.Config(dim=H, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=H, out_features=E),
            top_k=K,
            score_func="softmax",
            route_norm=True,
        ),
        load_balance_coeff=None,
    )
    with torch.device(device):
        layer = config.build()
    gate_up, down = ours.experts.gate_up_proj.detach(), ours.experts.down_proj.detach()
    with torch.no_grad():
        layer.router.gate.weight.copy_(ours.gate.weight)
        layer.routed_experts.inner_experts.w1_EFD.copy_(gate_up[:, :F])
        layer.routed_experts.inner_experts.w3_EFD.copy_(gate_up[:, F:])
        layer.routed_experts.inner_experts.w2_EDF.copy_(down)
    return layer.to(torch.bfloat16).train()


def time_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, args: Any) -> float:
    params = [p for p in layer.parameters() if p.requires_grad]

    def step() -> None:
        layer(x).backward(grad)
        x.grad = None
        for p in params:
            p.grad = None

    return median_ms(step, x.device, args.warmup, args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["fine", "coarse"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    add_record_args(parser)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        if shape.shared_inter:
            log(f"{name}: has a shared expert; torchtitan's layer is compared without one only")
            continue
        ours = build_layer(shape, "none", device, torch.bfloat16)
        ours.config = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0)
        titan = torchtitan_layer(shape, ours, device)
        g = torch.Generator(device=device).manual_seed(1)
        x2 = torch.randn(args.tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=g)
        grad2 = torch.randn_like(x2)
        x = x2.view(1, args.tokens, shape.hidden).requires_grad_(True)  # torchtitan takes [B, L, D]
        grad = grad2.view_as(x)
        with torch.no_grad():  # the same outputs from the same weights (routing ties aside)
            diff = (ours(x2) - titan(x).view_as(x2)).abs().max().item()
        counts = [int(c) for c in ours.tokens_per_expert.tolist()]  # this input's rows per expert
        floor = grouped_gemm_fwd_bwd_ms(counts, shape.hidden, shape.inter, device, torch.bfloat16)
        for label, layer, inputs, g_out in [
            ("lightning_ep", ours, x2.requires_grad_(True), grad2),
            ("torchtitan 0.3.0", titan, x, grad),
            ("torchtitan 0.3.0", titan, x, grad),
            ("lightning_ep", ours, x2, grad2),
        ]:
            ms = time_fwd_bwd(layer, inputs, g_out, args)
            rows.append({"shape": name, "layer": label, "fwd+bwd ms": ms, "x floor": ms / floor, "floor ms": floor})
        log(f"{name}: max |ours - torchtitan| of the outputs {diff:.3g}")
    title = f"One MoE layer beside torchtitan's, {args.tokens} tokens, bf16, one GPU"
    report(title, markdown_table(rows), "floor: the experts' grouped GEMMs alone", args.record, args.results)


if __name__ == "__main__":
    main()
