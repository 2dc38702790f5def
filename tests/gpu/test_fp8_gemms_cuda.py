"""FP8 expert GEMMs (``ExpertParallelStrategy(expert_gemms="fp8")``) on a GPU of compute capability 9.0+.

- The FP8 grouped MLP follows an fp32 reference (per-expert GEMMs of the same weights) within FP8's
  rounding, forward and all three gradients, on ragged experts (one empty, none a multiple of 16)
  with a static plan's padding rows after the last offset (a row count not a multiple of 16).
- Through the Trainer (``bf16-mixed``, fp32 master weights): the setup table names the choice, CUDA
  graphs (auto at degree 1) replay the FP8 path with the eager path's bits, and 200 steps learn as
  well as the bf16 GEMMs' run (the last 20 steps' mean loss at most 1% above).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mixtral_config

from lightning_ep.moe.experts.fp8 import fp8_gemms_blocker, fp8_grouped_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or fp8_gemms_blocker(torch.device("cuda")) is not None,
        reason="needs a GPU of compute capability 9.0+ and torchao",
    ),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_mlp_follows_an_fp32_reference_within_fp8_rounding() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [37, 0, 130, 5, 64, 21]
    rows, padding, H, inter = sum(counts), 11, 256, 128
    x = torch.randn(rows + padding, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(len(counts), 2 * inter, H, device="cuda", generator=g) / H**0.5).requires_grad_()
    w2 = (torch.randn(len(counts), H, inter, device="cuda", generator=g) / inter**0.5).requires_grad_()
    offsets = torch.cumsum(torch.tensor(counts, device="cuda"), 0).to(torch.int32)
    y = fp8_grouped_mlp(x, w1, w2, offsets_L=offsets, act_fn=F.silu)
    grad = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    y.backward(grad)
    ours = [y, x.grad, w1.grad, w2.grad]
    assert w1.grad.dtype == torch.float32 and y.dtype == torch.bfloat16

    # The reference: fp32 per-expert GEMMs on the same bf16 rows and fp32 weights.
    xr, w1r, w2r = (t.detach().float().requires_grad_() for t in (x, w1, w2))
    outs, start = [], 0
    for e, n in enumerate(counts):
        h = xr[start : start + n] @ w1r[e].t()
        gate, up = h.chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2r[e].t())
        start += n
    yr = torch.cat(outs)
    yr.backward(grad[:rows].float())
    reference = [yr, xr.grad[:rows], w1r.grad, w2r.grad]
    for name, a, b in zip(("y", "grad x", "grad w1", "grad w2"), ours, reference, strict=True):
        a = a[:rows] if name in ("y", "grad x") else a
        # Two chained GEMMs on e4m3 operands (<= 2^-4 each): 6.6% for y in the CPU emulation of the same
        # rounding (tests/unit/test_fp8_gemms.py), whose layout there equals the per-expert GEMMs exactly.
        assert _rel(a, b) < 0.1, (name, _rel(a, b))
    assert torch.count_nonzero(w1.grad[1]) == 0, "the empty expert gets no gradient"


def _fit(steps: int, *, fp8: bool, graphs: bool | str = "auto") -> tuple[list[float], dict, Any]:
    import lightning.pytorch as pl
    from transformers import MixtralForCausalLM

    from lightning_ep import Execution, ExpertParallelStrategy, MoEConfig

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                torch.manual_seed(0)
                config = tiny_mixtral_config(hidden_size=128, intermediate_size=64, num_hidden_layers=2)
                self.model = MixtralForCausalLM(config)

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

        def on_train_end(self) -> None:
            from lightning_ep import moe_layers

            graphed = [layer.graphed.graphs for layer in moe_layers(self) if layer.graphed is not None]
            self.captured = any(g is not None and g.fwd is not None for g in graphed)

    # 96 sequences seen about 8 times each in 200 steps: the loss falls from ln(128) without reaching 0,
    # so the curves are compared on a loss that still measures the model.
    data = torch.randint(0, 128, (96, 32), generator=torch.Generator().manual_seed(1)).repeat(steps // 24 + 1, 1)
    module = Module()
    strategy = ExpertParallelStrategy(
        1,
        moe=MoEConfig(moe_load_balancing="none"),
        execution=Execution(compile=False, cuda_graphs=graphs),  # type: ignore[arg-type]
        expert_gemms="fp8" if fp8 else None,
    )
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data[: steps * 4], batch_size=4))
    params = {k: v.detach().float().cpu() for k, v in module.model.state_dict().items()}
    strategy.captured = module.captured
    return [float(x) for x in module.losses], params, strategy


def test_graphs_replay_the_fp8_path_with_its_bits(single_process: None) -> None:
    graphed_losses, graphed_params, graphed = _fit(5, fp8=True)
    row = next(c for c in graphed.resolved.choices if c.name == "expert_gemms")
    assert row.value == "fp8" and "row-wise" in row.reason
    assert graphed.resolved.cuda_graphs and graphed.captured, "the FP8 MoE layers replayed CUDA graphs"
    eager_losses, eager_params, _ = _fit(5, fp8=True, graphs=False)
    assert graphed_losses == eager_losses
    for name, value in eager_params.items():
        assert torch.equal(graphed_params[name], value), name
    bf16_losses, _, _ = _fit(5, fp8=False, graphs=False)
    assert bf16_losses != eager_losses, "the FP8 GEMMs ran"


def test_200_steps_learn_as_well_as_the_bf16_gemms(single_process: None) -> None:
    """FP8 GEMMs do not learn worse: the last 20 steps' mean loss at most 1% above bf16's. One-sided: a
    tiny model memorising its data amplifies any difference into another trajectory, so the two curves
    part both ways by more than FP8's rounding explains (on one H100 the FP8 run ended 1.1% below
    bf16's with 16 sequences, 1.9% below with 96); the real shapes' 200 steps are in RESULTS.md."""
    fp8_losses, _, _ = _fit(200, fp8=True)
    bf16_losses, _, _ = _fit(200, fp8=False)
    assert bf16_losses[-1] < 0.8 * bf16_losses[0] and fp8_losses[-1] < 0.8 * fp8_losses[0], "the loss fell"
    fp8_tail, bf16_tail = sum(fp8_losses[-20:]) / 20, sum(bf16_losses[-20:]) / 20
    assert fp8_tail < 1.01 * bf16_tail, (fp8_tail, bf16_tail)
