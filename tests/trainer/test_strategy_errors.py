"""Bad configurations fail before the first training step, with a message naming the fix."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ep import Execution, ExpertParallelStrategy, MoEConfig
from lightning_ep.execution.choices import Environment, resolve


class Module(LightningModule):
    def __init__(self, build=None) -> None:
        super().__init__()
        self.build = build
        self.model = None
        self.steps = 0

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class NoConfigureModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.model = _mixtral()

    def training_step(self, batch, batch_idx):
        raise AssertionError("must not be reached")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _mixtral():
    from conftest import tiny_mixtral

    return tiny_mixtral()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    )


def _fit(module: LightningModule, strategy: ExpertParallelStrategy, precision: str = "32-true") -> None:
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = DataLoader(torch.randint(0, 128, (4, 8)), batch_size=2)
    trainer.fit(module, data)


def test_degree_not_dividing_world_size(single_process) -> None:
    module = Module(_mixtral)
    with pytest.raises(ValueError, match=re.escape("degree=2 does not divide the world size 1; choose one of [1]")):
        _fit(module, ExpertParallelStrategy(2, process_group_backend="gloo"))
    assert module.steps == 0


@pytest.mark.parametrize(
    ("devices", "num_nodes", "kwargs", "message"),
    [
        (4, 1, {"degree": 3}, "ExpertParallelStrategy(degree=3, replicate_degree=1) with Trainer(devices=4, "
         "num_nodes=1): degree=3 does not divide the world size 4; choose one of [1, 2, 4]."),
        (2, 2, {"degree": 3}, "with Trainer(devices=2, num_nodes=2): degree=3 does not divide the world size 4"),
        (4, 1, {"degree": 2, "replicate_degree": 4}, "replicate_degree=4) with Trainer(devices=4, num_nodes=1): "
         "world size 4 is not divisible by replicate_degree * degree = 4 * 2; with degree=2 choose replicate_degree "
         "in [1, 2]."),
    ],
    ids=["degree-3-of-4", "degree-3-of-2x2-nodes", "replicate-4-degree-2-of-4"],
)  # fmt: skip
def test_layout_checked_at_trainer_construction(devices: int, num_nodes: int, kwargs: dict, message: str) -> None:
    """Inside ``Trainer(...)``, before any process starts: Lightning's launcher would start them at
    ``fit`` and each would print the error."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=ExpertParallelStrategy(**kwargs))


def test_precision_checked_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match=re.escape("does not support precision='16-true'; choose one of")):
        Trainer(accelerator="cpu", devices=4, strategy=ExpertParallelStrategy(2), precision="16-true")


def test_auto_degree_and_a_fitting_layout_construct() -> None:
    for strategy in (ExpertParallelStrategy("auto"), ExpertParallelStrategy(2, replicate_degree=2)):
        assert Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False).strategy is strategy


def test_fp16_weights_under_32_true_name_the_dtype(single_process) -> None:
    """float16 weights under ``precision="32-true"`` overflow (a norm weight of 3e4 times unit
    activations passes 65504 in the next matmul); the error says so, and the same weights in float32
    train. Other non-finite values keep the usual advice (``test_robustness.py``)."""

    def build(dtype: torch.dtype):
        model = _mixtral().to(dtype)
        with torch.no_grad():
            model.model.layers[1].post_attention_layernorm.weight.fill_(3e4)
        return model

    module = Module(lambda: build(torch.float16))
    message = (
        "non-finite router logits or outputs in MoE layer(s) [1] at global step 0 (on at least one rank). The MoE "
        "weights are float16 under Trainer(precision='32-true'), which computes in the weights' own dtype (float16 "
        "overflows past 65504): use precision='bf16-mixed' or 'bf16-true', or cast the model to float32 (e.g. "
        "self.model.float() in configure_model)."
    )
    with pytest.raises(FloatingPointError, match=re.escape(message)):
        _fit(module, ExpertParallelStrategy(1, process_group_backend="gloo"))
    module = Module(lambda: build(torch.float32))
    _fit(module, ExpertParallelStrategy(1, process_group_backend="gloo"))
    assert module.steps == 1


def test_model_without_moe_block(single_process) -> None:
    module = Module(_llama)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "is not a supported MoE family; supported: "
            "['deepseek_v3', 'glm4_moe', 'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe']."
        ),
    ):
        _fit(module, ExpertParallelStrategy(1, process_group_backend="gloo"))
    assert module.steps == 0


def test_meta_model_without_configure_model(single_process) -> None:
    with pytest.raises(TypeError, match="holds meta-device weights but does not override configure_model"):
        _fit(NoConfigureModel(), ExpertParallelStrategy(1, process_group_backend="gloo"))


def test_half_precision_true_refused(single_process) -> None:
    module = Module(_mixtral)
    with pytest.raises(ValueError, match=re.escape("does not support precision='16-true'; choose one of")):
        _fit(module, ExpertParallelStrategy(1, process_group_backend="gloo"), precision="16-true")
    assert module.steps == 0


def test_fp16_mixed_refused_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match=r"does not support .*precision='16-mixed'.*Choose a different precision"):
        Trainer(accelerator="cpu", devices=1, strategy=ExpertParallelStrategy(1), precision="16-mixed")


def test_smp_moe_false_needs_degree_one() -> None:
    with pytest.raises(ValueError, match=r"degree=2\) with MoEConfig\(smp_moe=False\).*use degree=1"):
        ExpertParallelStrategy(2, moe=MoEConfig(smp_moe=False))


def test_smp_moe_false_trains_the_models_own_blocks(single_process) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from lightning_ep import moe_layers

    module = Module(_mixtral)
    _fit(module, ExpertParallelStrategy("auto", moe=MoEConfig(smp_moe=False), process_group_backend="gloo"))
    assert module.steps == 1
    assert not moe_layers(module.model)
    assert any(isinstance(m, MixtralSparseMoeBlock) for m in module.model.modules())


def test_compile_with_the_models_own_blocks(single_process) -> None:
    """With ``smp_moe=False`` the decoder layers' children, the model's own MoE block included, are
    compiled; the first step's loss is the eager model's to float rounding."""
    from conftest import rel_err

    from lightning_ep.parallel.compile import is_compiled

    class Recording(Module):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.first_loss = loss.detach().clone()
            return loss

    data = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    reference = _mixtral()
    expected = reference(input_ids=data[:2], labels=data[:2], use_cache=False).loss
    module = Recording(_mixtral)
    strategy = ExpertParallelStrategy(
        "auto", moe=MoEConfig(smp_moe=False), execution=Execution(compile=True), process_group_backend="gloo"
    )
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=2))
    blocks = list(module.model.model.layers)
    assert blocks and all(is_compiled(block) for block in blocks)
    assert module.model.config.use_cache is False
    assert rel_err(module.first_loss, expected) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"tensor_parallel_size": 2},
            ValueError,
            "tensor parallelism cannot be combined with expert parallelism",
        ),
        ({"degree": 0}, ValueError, r"degree=0\): pass an int >= 1 .* or 'auto'"),
        ({"degree": "three"}, ValueError, r"degree='three'\): pass an int >= 1"),
        ({"replicate_degree": 0}, ValueError, r"replicate_degree=0\): pass an int >= 1"),
        (
            {"timeout": 30},
            TypeError,
            r"timeout=30\): pass a datetime.timedelta, e.g. timedelta\(seconds=30\), or None for torch's default",
        ),
        ({"moe_model": 1}, TypeError, r"moe_model=1\): pass the attribute path of the Hugging Face model .* a str"),
        ({"moe": {"moe_load_balancing": "none"}}, TypeError, "moe=...\\) must be a MoEConfig, got dict"),
        (
            {"activation_checkpointing": "selective"},
            ValueError,
            r"activation_checkpointing='selective'\): pass True, False or 'keep_all_to_all'",
        ),
        (
            {"activation_checkpointing": "keep_all_to_all", "moe": MoEConfig(moe_all_to_all_dispatcher=False)},
            ValueError,
            r"keeps the all-to-all dispatcher's exchanges, but MoEConfig has moe_all_to_all_dispatcher=False, "
            r"capacity_factor=None; use the dropless all-to-all dispatcher \(True, None\)",
        ),
        (
            {"activation_checkpointing": "keep_all_to_all", "moe": MoEConfig(capacity_factor=1.0)},
            ValueError,
            r"moe_all_to_all_dispatcher=True, capacity_factor=1.0; use the dropless",
        ),
    ],
)
def test_constructor_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ExpertParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("execution", "checkpointing", "degree", "message"),
    [
        (
            Execution(exchange="symmetric_memory"),
            "keep_all_to_all",
            2,
            r"ExpertParallelStrategy\(activation_checkpointing='keep_all_to_all'\) keeps the collective all-to-all's "
            r"exchanges, but Execution\(exchange='symmetric_memory'\); use exchange='auto', or "
            r"activation_checkpointing=True\.",
        ),
        (
            Execution(cuda_graphs=True),
            True,
            1,
            r"Execution\(cuda_graphs=True\) needs no activation checkpointing; use cuda_graphs='auto'\.",
        ),
        (
            Execution(exchange="symmetric_memory", row_budget=1024, cuda_graphs=True),
            True,
            2,
            r"Execution\(row_budget=1024\) reruns a forward over budget before its backward, but activation "
            r"checkpointing \(True\) recomputes the layers inside the backward",
        ),
    ],
    ids=["symmetric-keep-all-to-all", "graphs-checkpointing", "budget-checkpointing"],
)
def test_execution_contradicting_activation_checkpointing(
    execution: Execution, checkpointing: bool | str, degree: int, message: str
) -> None:
    """Choices of ``Execution`` that ``activation_checkpointing`` cannot run with are refused when the
    strategy resolves them at setup (from what it runs on: here one node of CUDA GPUs), before any step;
    ``MoEConfig`` holds none of them any more (``tests/unit/test_config.py``)."""
    env = Environment(
        device_type="cuda",
        triton=True,
        num_nodes=1,
        devices_per_node=degree,
        degree=degree,
        precision="bf16-mixed",
        activation_checkpointing=checkpointing,
    )
    with pytest.raises(ValueError, match=message):
        resolve(execution, env, MoEConfig())


def test_execution_that_cannot_apply_is_refused_before_the_first_step(single_process) -> None:
    """Through the Trainer: the strategy resolves its ``Execution`` at setup."""
    module = Module(_mixtral)
    strategy = ExpertParallelStrategy(1, execution=Execution(token_dedup=True), process_group_backend="gloo")
    with pytest.raises(ValueError, match=r"Execution\(token_dedup=True\) deduplicates the dropless .* degree=1"):
        _fit(module, strategy)
    assert module.steps == 0


def test_registered_name() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, strategy="expert_parallel", logger=False)
    assert isinstance(trainer.strategy, ExpertParallelStrategy)
    assert trainer.strategy.degree == 1
