"""The automatic execution choices on one GPU, in real Trainer runs: what ``Execution()`` picks there
(CUDA graphs, the fused AdamW kernels, compile) gives the numbers of the path with every choice
off: bit for bit for graphs and AdamW (both are exact), to bf16 rounding with compile (Inductor
reorders float sums). The pure choices are tested on CPU in ``tests/unit/test_execution.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_mixtral_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 5


def _fit(
    execution: Any, balancing: str, *, lora: bool = False, precision: str = "bf16-true"
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    import lightning.pytorch as pl
    from transformers import MixtralForCausalLM

    from lightning_ep import ExpertParallelStrategy, MoEConfig

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                torch.manual_seed(0)
                config = tiny_mixtral_config(hidden_size=128, intermediate_size=64, num_hidden_layers=2)
                self.model = MixtralForCausalLM(config)
                if lora:  # PEFT LoRA on attention and on both expert weights, rank 8 (grouped-GEMM aligned)
                    from peft import LoraConfig, get_peft_model

                    targets = ["experts.gate_up_proj", "experts.down_proj"]
                    adapters = LoraConfig(
                        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], target_parameters=targets
                    )
                    self.model = get_peft_model(self.model, adapters)

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

        def on_train_end(self) -> None:  # before the strategy's teardown drops the graphs
            from lightning_ep import moe_layers

            graphs = [layer._layer_graphs for layer in moe_layers(self)]
            self.captured = any(g is not None and g.fwd is not None for g in graphs)

    data = torch.randint(0, 128, (STEPS * 4, 32), generator=torch.Generator().manual_seed(1))
    module = Module()
    strategy = ExpertParallelStrategy(1, moe=MoEConfig(moe_load_balancing=balancing), execution=execution)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    params = {k: v.detach().float().cpu() for k, v in module.model.state_dict().items()}
    strategy.captured = module.captured
    return [float(x) for x in module.losses], params, strategy


@pytest.mark.parametrize("balancing", ["none", "sinkhorn"])
def test_automatic_graphs_and_adamw_give_the_same_bits(single_process: None, balancing: str) -> None:
    from lightning_ep import Execution
    from lightning_ep.optim import AdamW

    auto_losses, auto_params, auto = _fit(Execution(compile=False), balancing)
    assert auto.resolved.cuda_graphs and auto.resolved.fused_adamw
    assert type(auto.optimizers[0]) is AdamW, "torch.optim.AdamW(fused=True) steps with the kernels"
    assert auto.captured, "the MoE layers replayed CUDA graphs"
    off_losses, off_params, off = _fit(Execution(compile=False, cuda_graphs=False, fused_adamw=False), balancing)
    assert type(off.optimizers[0]) is torch.optim.AdamW
    assert auto_losses == off_losses
    for name, value in off_params.items():
        assert torch.equal(auto_params[name], value), name


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_lora_experts_replay_graphs_with_the_same_bits(single_process: None, precision: str) -> None:
    """LoRA factors on the experts are graph inputs like the base weights: the replayed steps give
    the eager steps' losses and adapters bit for bit, and the frozen weights stay as they were."""
    from lightning_ep import Execution

    graphs_losses, graphs_params, graphs = _fit(Execution(compile=False), "none", lora=True, precision=precision)
    assert graphs.resolved.cuda_graphs and graphs.captured, "LoRA experts replayed CUDA graphs"
    eager_losses, eager_params, _ = _fit(
        Execution(compile=False, cuda_graphs=False), "none", lora=True, precision=precision
    )
    assert graphs_losses == eager_losses
    assert any("lora_B" in name and value.abs().sum() > 0 for name, value in eager_params.items()), "adapters trained"
    for name, value in eager_params.items():
        assert torch.equal(graphs_params[name], value), name


def test_automatic_compile_agrees_to_bf16_rounding(single_process: None) -> None:
    from lightning_ep import Execution

    auto_losses, _, auto = _fit(Execution(), "sinkhorn")
    assert auto.resolved.compile and auto.resolved.cuda_graphs
    off_losses, _, _ = _fit(Execution(compile=False, cuda_graphs=False, fused_adamw=False), "sinkhorn")
    # bf16 parameters and activations: the compiled norms' reordered sums move the loss by a few bf16 ulps.
    for mine, theirs in zip(auto_losses, off_losses, strict=True):
        assert abs(mine - theirs) <= 2e-2 * abs(theirs), (auto_losses, off_losses)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_dense_parameters_in_place_give_the_bits_of_fsdp2(single_process: None, precision: str) -> None:
    """The defaults on one GPU (compile, CUDA graphs that take the routing, so the router's weight and
    its gradient pass through the graphs' buffers) with the dense parameters used in place: the
    losses and weights of the FSDP2 path of larger worlds (``single_rank_fsdp=False``), bit for bit."""
    from lightning_ep import Execution
    from lightning_ep.parallel.single_rank import is_kept_local

    local_losses, local_params, local = _fit(Execution(), "sinkhorn", precision=precision)
    assert local.resolved.single_rank_fsdp and is_kept_local(local._hf_model)
    assert local.resolved.compile and local.captured
    fsdp_losses, fsdp_params, fsdp = _fit(Execution(single_rank_fsdp=False), "sinkhorn", precision=precision)
    assert not is_kept_local(fsdp._hf_model)
    assert local_losses == fsdp_losses
    for name, value in fsdp_params.items():
        assert torch.equal(local_params[name], value), name
