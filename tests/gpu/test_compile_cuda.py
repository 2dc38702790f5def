"""On CUDA: decoder layers compiled around their MoE layers, and the loss (``compile_for_training``,
the path ``Execution(compile=True)`` takes) compute what the eager ones do.

The CPU twin is ``tests/unit/test_compile.py``. On CUDA inductor emits Triton kernels whose fp32
reductions are ordered differently from ATen's, so losses and gradients agree to float rounding
(1e-5 relative asserted, TF32 off), not bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err

import lightning_ep
from lightning_ep.parallel.compile import compile_for_training, compile_loss
from lightning_ep.parallel.fsdp import decoder_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_compiled_layers_match_eager_on_cuda() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    moe = lightning_ep.MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    eager = lightning_ep.transform(MixtralForCausalLM(config).float(), moe).cuda().train()
    compiled = copy.deepcopy(eager)
    assert compile_for_training(compiled, decoder_blocks(compiled)) == 2
    assert not compile_loss(compiled), "compile_for_training compiles the loss too"
    ids = torch.randint(0, 256, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for step in range(2):
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert rel_err(losses[1], losses[0]) < 1e-5, (step, losses)
        grads = dict(eager.named_parameters())
        for name, param in compiled.named_parameters():
            assert rel_err(param.grad, grads[name].grad) < 1e-5, (step, name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_every_family_compiles_and_matches_eager_on_cuda(family: str) -> None:
    """``Execution(compile="auto")`` compiles every family on CUDA: each must trace and agree with eager."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
    from conftest import tiny_mixtral
    from families_workers import tiny_family

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = tiny_mixtral() if family == "mixtral" else tiny_family(family)
    moe = lightning_ep.MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    eager = lightning_ep.transform(model, moe).cuda().train()
    compiled = copy.deepcopy(eager)
    assert compile_for_training(compiled, decoder_blocks(compiled)) >= 1
    ids = torch.randint(0, 128, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for step in range(2):
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        assert rel_err(losses[1], losses[0]) < 1e-5, (family, step, losses)
        grads = dict(eager.named_parameters())
        for name, param in compiled.named_parameters():
            if param.grad is not None or grads[name].grad is not None:
                assert rel_err(param.grad, grads[name].grad) < 1e-4, (family, step, name)
