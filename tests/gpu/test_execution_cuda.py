"""The automatic execution choices on one GPU, in real Trainer runs: what ``Execution()`` picks there
(CUDA graphs, compile) with ``lightning_ep.optim.AdamW``'s kernels gives the numbers of the path with
every choice off and ``torch.optim.AdamW(fused=True)``: bit for bit for graphs and AdamW (both are
exact), to bf16 rounding with compile (Inductor reorders float sums). The setup table's
``fused_adamw`` row says what steps, under an LR scheduler too, counted by the optimizer's
``kernel_launches``. The pure choices are tested on CPU in ``tests/unit/test_execution.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_mixtral_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 5
#: ``lightning_ep.optim.AdamW(min_kernel_numel=...)`` here: the tiny model's expert weights (8 x 128 x 128)
#: and embeddings take the kernel, its norms and biases ``torch._fused_adamw_``.
MIN_KERNEL_NUMEL = 4096


def _fit(
    execution: Any,
    balancing: str,
    *,
    lora: bool = False,
    precision: str = "bf16-true",
    optimizer: str = "torch",
    scheduler: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """``STEPS`` steps of a tiny Mixtral; ``optimizer``: ``"torch"`` (``torch.optim.AdamW(fused=True)``)
    or ``"lightning_ep"``; ``scheduler``: a halving ``LambdaLR`` stepped by Lightning every step. The
    returned strategy carries the optimizer the module built (``built_optimizer``)."""
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

        def configure_optimizers(self) -> Any:
            from lightning_ep.optim import AdamW

            built: torch.optim.Optimizer
            if optimizer == "lightning_ep":
                built = AdamW(self.parameters(), lr=1e-3, min_kernel_numel=MIN_KERNEL_NUMEL)
            else:
                built = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
            self.built_optimizer = built
            if not scheduler:
                return built
            halving = torch.optim.lr_scheduler.LambdaLR(built, lambda step: 0.5**step)
            return {"optimizer": built, "lr_scheduler": {"scheduler": halving, "interval": "step"}}

        def on_train_end(self) -> None:  # before the strategy's teardown drops the graphs
            from lightning_ep import moe_layers

            graphs = [layer.graphed.graphs for layer in moe_layers(self) if layer.graphed is not None]
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
    strategy.built_optimizer = module.built_optimizer
    return [float(x) for x in module.losses], params, strategy


def _row(strategy: Any, name: str) -> tuple[str, str]:
    return next((c.value, c.reason) for c in strategy.resolved.choices if c.name == name)


@pytest.mark.parametrize("balancing", ["none", "sinkhorn"])
def test_automatic_graphs_and_adamw_give_the_same_bits(single_process: None, balancing: str) -> None:
    from lightning_ep import Execution

    auto_losses, auto_params, auto = _fit(Execution(compile=False), balancing, optimizer="lightning_ep")
    assert auto.resolved.cuda_graphs and auto.resolved.fused_adamw
    assert auto.built_optimizer.kernel_launches > 0, "lightning_ep.optim.AdamW stepped with its kernels"
    assert auto.captured, "the MoE layers replayed CUDA graphs"
    off_losses, off_params, off = _fit(Execution(compile=False, cuda_graphs=False, fused_adamw=False), balancing)
    assert type(off.built_optimizer) is torch.optim.AdamW and _row(off, "fused_adamw") == ("off", "forced")
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


@pytest.mark.parametrize("scheduler", [False, True])
def test_the_table_says_what_steps_under_a_scheduler(single_process: None, scheduler: bool) -> None:
    """With ``"balanced"`` routing (its biases moved by the strategy's step post-hook), with and without
    a ``LambdaLR`` (which wraps the optimizer's bound ``step``): ``lightning_ep.optim.AdamW`` is reported
    on and launches its kernel once per large tensor per step; ``torch.optim.AdamW(fused=True)`` is
    reported off, keeps its class and steps with torch's kernels; both move the biases and give the
    same bits."""
    from lightning_ep import Execution
    from lightning_ep.moe.experts.grouped import local_tensor
    from lightning_ep.optim import AdamW

    ours_losses, ours_params, ours = _fit(
        Execution(compile=False), "balanced", optimizer="lightning_ep", scheduler=scheduler
    )
    optimizer = ours.built_optimizer
    assert type(optimizer) is AdamW and ours.optimizers == [optimizer]
    assert ours.resolved.fused_adamw
    assert _row(ours, "fused_adamw") == (
        "on",
        "lightning_ep.optim.AdamW: torch's fused AdamW bits, a Triton kernel per large tensor",
    )
    large = [p for p in optimizer.param_groups[0]["params"] if local_tensor(p).numel() >= MIN_KERNEL_NUMEL]
    assert large and optimizer.kernel_launches == STEPS * len(large)
    assert optimizer.param_groups[0]["lr"] == (1e-3 * 0.5**STEPS if scheduler else 1e-3)

    theirs_losses, theirs_params, theirs = _fit(
        Execution(compile=False), "balanced", optimizer="torch", scheduler=scheduler
    )
    assert type(theirs.built_optimizer) is torch.optim.AdamW and not theirs.resolved.fused_adamw
    assert _row(theirs, "fused_adamw") == (
        "off",
        "torch.optim.AdamW steps with torch's kernels; lightning_ep.optim.AdamW steps the same bits faster",
    )
    biases = [name for name in ours_params if name.endswith("expert_bias")]
    assert len(biases) == 2  # one per MoE layer
    for name in biases:
        assert ours_params[name].abs().sum() > 0 and theirs_params[name].abs().sum() > 0, name
    assert ours_losses == theirs_losses
    for name, value in theirs_params.items():
        assert torch.equal(ours_params[name], value), name


def test_forcing_fused_adamw_against_the_optimizer_is_refused_at_setup(single_process: None) -> None:
    from lightning_ep import Execution

    with pytest.raises(ValueError, match=r"Execution\(fused_adamw=False\), but configure_optimizers returned"):
        _fit(Execution(compile=False, cuda_graphs=False, fused_adamw=False), "none", optimizer="lightning_ep")
    with pytest.raises(ValueError, match=r"Execution\(fused_adamw=True\) needs lightning_ep.optim.AdamW, but "):
        _fit(Execution(compile=False, cuda_graphs=False, fused_adamw=True), "none", optimizer="torch")
