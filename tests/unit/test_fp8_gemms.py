"""FP8 expert GEMMs on CPU: the padded layout, the MLP's plumbing around the FP8 grouped GEMM (an
emulation of torchao's row-wise scaling stands in for the kernel, which needs a Hopper GPU; the
kernel itself is tested in ``tests/gpu/test_fp8_gemms_cuda.py``), and every refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mixtral_config

import lightning_ep
from lightning_ep import ExpertParallelStrategy, MoEConfig
from lightning_ep.moe.experts import fp8
from lightning_ep.moe.experts.mlp import grouped_mlp
from lightning_ep.strategy.arguments import check_expert_gemms


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


@pytest.mark.parametrize("counts", [[37, 0, 130, 5, 64, 21], [16, 32], [0, 0, 3], [1]])
def test_padded_rows_place_each_expert_at_a_multiple_of_16(counts: list[int]) -> None:
    rows = sum(counts) + 7  # a static plan's padding rows after the last offset
    target, offsets, size = fp8.padded_rows(_offsets(counts), rows)
    assert size == -(-rows // 16) * 16 + 16 * len(counts) and size % 16 == 0
    assert target.shape == (rows,) and offsets.dtype == torch.int32
    padded = [-(-n // 16) * 16 for n in counts]
    assert offsets.tolist() == torch.cumsum(torch.tensor(padded), 0).tolist()
    start, padded_start = 0, 0
    for n, p in zip(counts, padded, strict=True):
        assert target[start : start + n].tolist() == list(range(padded_start, padded_start + n))
        start, padded_start = start + n, padded_start + p
    # The padding rows go after the last block, in order, inside the buffer.
    assert target[start:].tolist() == list(range(padded_start, padded_start + rows - start))
    assert int(target.max()) < size and len(set(target.tolist())) == rows


def _fp8_rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` rounded as torchao's row-wise FP8 casting rounds it (a power-of-two scale per slice along
    ``dim``, e4m3), in ``t``'s dtype, with a straight-through gradient."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    q = (t.detach().float() * scale).to(torch.float8_e4m3fn).float() / scale
    return t + (q - t.detach().float()).to(t.dtype)


def _emulated_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """torchao's row-wise FP8 grouped GEMM's forward values, for the layout around it to be tested."""
    assert not kwargs["pad_token_groups_for_grouped_mm"] and b_t.stride(-2) == 1
    assert torch.all(torch.diff(offs, prepend=offs.new_zeros(1)) % fp8.ALIGN == 0), "blocks of 16 rows"
    return torch._grouped_mm(_fp8_rowwise(a, -1).float(), _fp8_rowwise(b_t, -2).float(), offs=offs).to(
        kwargs["out_dtype"]
    )


def test_the_mlp_around_the_fp8_gemm_equals_the_per_expert_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded layout changes nothing: the MLP equals each expert's rows through the same FP8
    rounding one expert at a time, up to one bf16 rounding of sums taken in another order (the
    GEMMs write bf16); the rows past the last offset give no weight gradient, an empty expert none."""
    monkeypatch.setattr(fp8, "_torchao_grouped_mm", lambda: _emulated_grouped_mm)
    g = torch.Generator().manual_seed(0)
    counts, padding, H, inter = [37, 0, 130, 5], 11, 64, 32
    rows = sum(counts)
    x = torch.randn(rows + padding, H, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(4, 2 * inter, H, generator=g) / H**0.5).requires_grad_()
    w2 = (torch.randn(4, H, inter, generator=g) / inter**0.5).requires_grad_()
    y = fp8.fp8_grouped_mlp(x, w1, w2, offsets_L=_offsets(counts), act_fn=F.silu)
    grad = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(grad)
    assert torch.count_nonzero(w1.grad[1]) == 0 and torch.count_nonzero(w1.grad[0]) > 0

    xr, w1r, w2r = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    outs, start = [], 0
    for e, n in enumerate(counts):
        h = (_fp8_rowwise(xr[start : start + n], -1).float() @ _fp8_rowwise(w1r[e].t(), -2).float()).bfloat16()
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
        outs.append((_fp8_rowwise(a, -1).float() @ _fp8_rowwise(w2r[e].t(), -2).float()).bfloat16())
        start += n
    yr = torch.cat(outs)
    yr.backward(grad[:rows])
    pairs = {"y": (y[:rows], yr), "grad x": (x.grad[:rows], xr.grad[:rows]), "grad w1": (w1.grad, w1r.grad)}
    pairs["grad w2"] = (w2.grad, w2r.grad)
    for name, (a, b) in pairs.items():
        error = float((a.detach().float() - b.float()).norm() / b.float().norm())
        assert error < 1e-3, (name, error)  # fp32 sums in another order may round a few elements to the next bf16
    # And the FP8 rounding did apply: a few percent from fp32 GEMMs.
    exact = grouped_mlp(x.detach().float()[:rows], _offsets(counts), w1.detach(), w2.detach(), F.silu, 1.0)
    assert 0.01 < float((y[:rows].detach().float() - exact).norm() / exact.norm()) < 0.1


def test_expert_gemms_refusals() -> None:
    with pytest.raises(ValueError, match=r"expert_gemms='bf16'\): pass 'fp8'"):
        ExpertParallelStrategy(expert_gemms="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FP8 GEMMs are for trainable experts"):
        ExpertParallelStrategy(expert_gemms="fp8", frozen_experts="fp8")
    with pytest.raises(ValueError, match="smp_moe=False"):
        ExpertParallelStrategy(expert_gemms="fp8", moe=MoEConfig(smp_moe=False))
    with pytest.raises(ValueError, match=r"needs a CUDA GPU of compute capability 9\.0 or later \(this is cpu\)"):
        check_expert_gemms("fp8", torch.device("cpu"), "bf16-mixed")


def test_experts_without_an_fp8_path_are_refused_by_name() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralForCausalLM

    model = lightning_ep.transform(MixtralForCausalLM(tiny_mixtral_config()), MoEConfig())
    assert fp8.use_fp8_gemms(model) == 2
    assert all(m.fp8_gemms for m in model.modules() if isinstance(m, fp8_experts_type()))
    lora = get_peft_model(
        MixtralForCausalLM(tiny_mixtral_config()), LoraConfig(r=8, target_parameters=["experts.gate_up_proj"])
    )
    lora = lightning_ep.transform(lora, MoEConfig())
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts is a LoRAGroupedExperts, which has no FP8 path"):
        fp8.use_fp8_gemms(lora)
    odd = lightning_ep.transform(MixtralForCausalLM(tiny_mixtral_config(intermediate_size=40)), MoEConfig())
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.use_fp8_gemms(odd)


def fp8_experts_type() -> type:
    from lightning_ep.moe.experts.grouped import GroupedExperts

    return GroupedExperts


def test_rows_in_another_dtype_are_refused() -> None:
    from transformers import MixtralForCausalLM

    model = lightning_ep.transform(MixtralForCausalLM(tiny_mixtral_config()), MoEConfig())
    fp8.use_fp8_gemms(model)
    with pytest.raises(
        RuntimeError,
        match=r"expert_gemms='fp8' runs GroupedExperts's grouped GEMMs on bf16 rows, which cannot run for "
        r"torch\.float32 rows",
    ):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_the_setup_table_prints_the_choice() -> None:
    from lightning_ep.execution.choices import Environment, Execution, resolve

    env = Environment(device_type="cuda", triton=True, num_nodes=1, devices_per_node=1, degree=1, expert_gemms="fp8")
    rows = {c.name: c for c in resolve(Execution(), env, MoEConfig()).choices}
    assert rows["expert_gemms"].value == "fp8" and "row-wise" in rows["expert_gemms"].reason
    plain = resolve(
        Execution(),
        Environment(device_type="cuda", triton=True, num_nodes=1, devices_per_node=1, degree=1),
        MoEConfig(),
    )
    assert "expert_gemms" not in {c.name for c in plain.choices}
