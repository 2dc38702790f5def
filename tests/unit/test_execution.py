"""``lightning_ep.execution.choices``: the automatic choices and the setup table are a pure function of the
environment, tested here for the environments a user meets; forced choices that cannot apply are
refused by name; the ``fused_adamw`` row reports what steps the optimizers Lightning set up, and
forcing it against them is refused."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_ep import Execution, LayerExecution, MoEConfig
from lightning_ep.execution.adamw import KERNEL_ADAMW, TORCH_ADAMW
from lightning_ep.execution.choices import Environment, Resolved, resolve, with_optimizers
from lightning_ep.execution.environment import optimizer_names


def _env(**overrides: object) -> Environment:
    values: dict[str, object] = {
        "device_type": "cuda",
        "triton": True,
        "num_nodes": 1,
        "devices_per_node": 1,
        "degree": 1,
        "precision": "bf16-mixed",
        "optimizers": (KERNEL_ADAMW,),  # what the README's module returns from configure_optimizers
    }
    values.update(overrides)
    return Environment(**values)  # type: ignore[arg-type]


def _rows(resolved: Resolved) -> dict[str, tuple[str, str]]:
    """The table's rows, each as (value, reason); the table prints one line per row."""
    rows = {c.name: (c.value, c.reason) for c in resolved.choices}
    lines = resolved.table().splitlines()[1:]
    assert len(lines) == len(rows)
    for line, (name, (value, reason)) in zip(lines, rows.items(), strict=True):
        assert line.split() == [name, *value.split(), *reason.split()]
    return rows


def test_cpu_runs_eager_with_the_collective_exchange() -> None:
    env = _env(device_type="cpu", devices_per_node=4, degree=2, precision="32-true")
    resolved = resolve(Execution(), env, MoEConfig())
    assert (resolved.compile, resolved.cuda_graphs, resolved.symmetric_memory, resolved.fused_adamw) == (
        False,
        False,
        False,
        False,
    )
    assert resolved.table().splitlines()[0] == "lightning_ep execution (cpu, 1 node x 4 processes, degree 2, 32-true):"
    rows = _rows(resolved)
    assert rows["compile"][0] == "off" and "CPU" in rows["compile"][1]
    assert rows["exchange"][0] == "all-to-all (gloo)"
    assert rows["token_dedup"][0] == "off"
    assert rows["row_budget"] == ("dynamic", "one host sync per layer (a static plan: row_budget='auto' or an int)")
    assert rows["cuda_graphs"] == ("off", "auto: off, needs CUDA with Triton")
    assert rows["fused_adamw"][0] == "off"


def test_frozen_experts_row_says_where_their_bytes_are_split() -> None:
    at_world = _rows(resolve(Execution(), _env(devices_per_node=4, degree=4, frozen_experts="fp8"), MoEConfig()))
    assert at_world["frozen_experts"][0] == "fp8" and "split" not in at_world["frozen_experts"][1]
    below = _rows(resolve(Execution(), _env(devices_per_node=4, degree=1, frozen_experts="mxfp4"), MoEConfig()))
    assert below["frozen_experts"][1].endswith("; each expert's bytes split over 4 ranks, gathered per layer")


def test_one_gpu_gets_compile_graphs_and_the_fused_adamw() -> None:
    resolved = resolve(Execution(), _env(), MoEConfig())
    assert resolved.compile and resolved.cuda_graphs and resolved.fused_adamw and not resolved.symmetric_memory
    rows = _rows(resolved)
    # No dedup row at degree 1.
    assert list(rows) == ["compile", "exchange", "cuda_graphs", "single_rank_fsdp", "fused_adamw"]
    assert rows["exchange"][0] == "local"
    assert rows["cuda_graphs"] == ("on", "auto")
    assert resolved.single_rank_fsdp
    assert rows["single_rank_fsdp"] == ("on", "one rank: dense parameters used in place, no FSDP2 copies (same bits)")
    assert resolved.layers == LayerExecution(cuda_graphs=True)  # the local dispatch, no exchange choices


def test_single_rank_fsdp_applies_only_where_it_keeps_the_bits() -> None:
    """On at world size 1 (CPU too); off, with the reason, under gradient accumulation, activation
    checkpointing or an explicit ``reshard_after_forward=True``; no row above world size 1; forcing it
    where it cannot apply is refused."""
    cpu = resolve(Execution(), _env(device_type="cpu", precision="32-true"), MoEConfig())
    assert cpu.single_rank_fsdp
    assert _rows(cpu)["single_rank_fsdp"] == (
        "on",
        "one rank: dense parameters used in place, no FSDP2 copies (same bits)",
    )
    accumulating = resolve(Execution(), _env(accumulate_grad_batches=4), MoEConfig())
    assert not accumulating.single_rank_fsdp
    assert _rows(accumulating)["single_rank_fsdp"] == (
        "off",
        "auto: needs no gradient accumulation (accumulate_grad_batches=4)",
    )
    checkpointed = resolve(Execution(), _env(activation_checkpointing=True), MoEConfig())
    assert _rows(checkpointed)["single_rank_fsdp"] == ("off", "auto: needs no activation checkpointing")
    explicit = resolve(Execution(), _env(reshard_after_forward=True), MoEConfig())
    assert _rows(explicit)["single_rank_fsdp"] == ("off", "auto: needs no reshard_after_forward=True")
    assert resolve(Execution(), _env(reshard_after_forward=False), MoEConfig()).single_rank_fsdp
    forced_off = resolve(Execution(single_rank_fsdp=False), _env(), MoEConfig())
    assert not forced_off.single_rank_fsdp and _rows(forced_off)["single_rank_fsdp"] == ("off", "forced")
    forced_on = resolve(Execution(single_rank_fsdp=True), _env(), MoEConfig())
    assert forced_on.single_rank_fsdp and _rows(forced_on)["single_rank_fsdp"][1].startswith("forced; one rank")
    two = resolve(Execution(), _env(devices_per_node=2), MoEConfig())
    assert not two.single_rank_fsdp and "single_rank_fsdp" not in _rows(two)
    for env, needs in [
        (_env(devices_per_node=2), "world size 1 (2 here)"),
        (_env(num_nodes=2), "world size 1 (2 here)"),
        (_env(accumulate_grad_batches=2), "no gradient accumulation (accumulate_grad_batches=2)"),
        (_env(activation_checkpointing="keep_all_to_all"), "no activation checkpointing"),
        (_env(reshard_after_forward=True), "no reshard_after_forward=True"),
    ]:
        with pytest.raises(ValueError, match=rf"single_rank_fsdp=True\) needs {re.escape(needs)}; use"):
            resolve(Execution(single_rank_fsdp=True), env, MoEConfig())
    with pytest.raises(TypeError, match=r"Execution\(single_rank_fsdp='yes'\): pass 'auto', True or False"):
        Execution(single_rank_fsdp="yes")  # type: ignore[arg-type]


def test_one_node_of_eight_gpus_keeps_the_dynamic_nccl_exchange() -> None:
    resolved = resolve(Execution(), _env(devices_per_node=8, degree=8, precision="bf16-true"), MoEConfig())
    rows = _rows(resolved)
    assert rows["exchange"][0] == "all-to-all (nccl)"
    assert rows["cuda_graphs"][0] == "off" and "static plan above degree 1" in rows["cuda_graphs"][1]
    assert resolved.compile and resolved.fused_adamw and not resolved.cuda_graphs


def test_several_nodes_with_checkpointing_and_experts_under_fsdp() -> None:
    env = _env(num_nodes=4, devices_per_node=8, degree=8, activation_checkpointing=True)
    rows = _rows(resolve(Execution(), env, MoEConfig()))
    assert rows["cuda_graphs"] == ("off", "auto: off, needs no activation checkpointing")
    env = _env(num_nodes=4, devices_per_node=8, degree=8)
    rows = _rows(resolve(Execution(), env, MoEConfig()))
    assert "expert weights that stay in place (degree 8 = world size 32)" in rows["cuda_graphs"][1]
    with pytest.raises(ValueError, match=r"every expert-parallel group on one node \(degree 16 > 8 per node\)"):
        resolve(Execution(exchange="symmetric_memory"), _env(num_nodes=2, devices_per_node=8, degree=16), MoEConfig())


def test_fp32_and_capacity_keep_graphs_off() -> None:
    assert "bf16 experts (precision is 32-true)" in resolve(Execution(), _env(precision="32-true"), MoEConfig()).table()
    table = resolve(Execution(), _env(), MoEConfig(capacity_factor=1.25)).table()
    assert "a dropless dispatch (capacity_factor is set)" in table
    assert resolve(Execution(), _env(lora_ranks=(8, 16)), MoEConfig()).cuda_graphs
    table = resolve(Execution(), _env(lora_ranks=(4, 16)), MoEConfig()).table()
    assert "expert LoRA ranks that are multiples of 8 for the grouped GEMM (ranks [4])" in table


def test_forced_choices_are_kept_or_refused_by_name() -> None:
    off = resolve(
        Execution(compile=False, cuda_graphs=False, fused_adamw=False), _env(optimizers=(TORCH_ADAMW,)), MoEConfig()
    )
    assert not (off.compile or off.cuda_graphs or off.fused_adamw)
    assert "forced" in _rows(off)["cuda_graphs"][1]
    assert _rows(off)["fused_adamw"] == ("off", "forced")
    cpu = _env(device_type="cpu", precision="32-true")
    with pytest.raises(
        ValueError, match=r"Execution\(cuda_graphs=True\) needs CUDA with Triton; use cuda_graphs='auto'"
    ):
        resolve(Execution(cuda_graphs=True), cpu, MoEConfig())
    with pytest.raises(ValueError, match=r"Execution\(fused_adamw=True\) needs CUDA with Triton \(CPU here\)"):
        resolve(Execution(fused_adamw=True), cpu, MoEConfig())
    with pytest.raises(ValueError, match=r"Execution\(token_dedup=True\) deduplicates the dropless"):
        resolve(Execution(token_dedup=True), _env(), MoEConfig())
    with pytest.raises(ValueError, match=r"the degree is 1"):
        resolve(Execution(exchange="symmetric_memory"), _env(), MoEConfig())
    symm = Execution(exchange="symmetric_memory", row_budget=4096, cuda_graphs=True)
    resolved = resolve(symm, _env(devices_per_node=2, degree=2), MoEConfig())
    assert resolved.symmetric_memory and resolved.cuda_graphs and resolved.row_budget == 4096
    assert resolved.layers == LayerExecution(exchange="symmetric_memory", row_budget=4096, cuda_graphs=True)
    resolved.layers.check(MoEConfig(), 2)  # what the layers are built with applies at that degree


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compile": "yes"}, TypeError, r"Execution\(compile='yes'\): pass 'auto', True or False"),
        ({"exchange": "nvlink"}, ValueError, r"Execution\(exchange='nvlink'\) is not one of"),
        ({"row_budget": 0}, ValueError, r"Execution\(row_budget=0\): pass an int >= 1"),
        ({"row_budget": "big"}, ValueError, r"Execution\(row_budget='big'\): pass an int >= 1 .*, 'auto'"),
        (
            {"row_budget": "auto", "exchange": "symmetric_memory"},
            ValueError,
            r"the symmetric-memory exchange takes an int budget",
        ),
        ({"row_budget": 64, "token_dedup": True}, ValueError, r"which token_dedup=True replaces; pass one of them"),
    ],
)
def test_bad_execution_values(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Execution(**kwargs)


ON = "lightning_ep.optim.AdamW: torch's fused AdamW bits, a Triton kernel per large tensor"


@pytest.mark.parametrize(
    ("env", "optimizers", "row"),
    [
        ({}, (KERNEL_ADAMW,), ("on", ON)),
        ({}, (KERNEL_ADAMW, TORCH_ADAMW), ("on", ON + "; torch.optim.AdamW: torch's kernels")),
        (
            {},
            (TORCH_ADAMW,),
            (
                "off",
                "torch.optim.AdamW steps with torch's kernels; lightning_ep.optim.AdamW steps the same bits faster",
            ),
        ),
        ({}, ("torch.optim.SGD",), ("off", "torch.optim.SGD steps with its own kernels (no AdamW)")),
        ({"device_type": "cpu", "precision": "32-true"}, (KERNEL_ADAMW,), ("off", "auto: off on CPU")),
        ({"triton": False}, (KERNEL_ADAMW,), ("off", "auto: off on no Triton")),
    ],
)
def test_the_fused_adamw_row_reports_what_steps_the_optimizers(
    env: dict, optimizers: tuple[str, ...], row: tuple[str, str]
) -> None:
    """The row says whether ``lightning_ep.optim.AdamW``'s kernels step an optimizer Lightning set up:
    only that class has them, and only on CUDA with Triton. Completing an earlier resolution with the
    optimizers gives what resolving with them gives."""
    resolved = resolve(Execution(), _env(**env, optimizers=optimizers), MoEConfig())
    assert _rows(resolved)["fused_adamw"] == row
    assert resolved.fused_adamw == (row[0] == "on")
    assert list(_rows(resolved))[-1] == "fused_adamw"
    early = resolve(Execution(), _env(**env, optimizers=None), MoEConfig())
    assert with_optimizers(early, Execution(), optimizers) == resolved


def test_no_fused_adamw_row_before_the_optimizers_exist() -> None:
    """Before ``configure_optimizers`` (and when not fitting) nothing steps: no row, and a forced value
    is checked only against the device."""
    for option in ("auto", True, False):
        resolved = resolve(Execution(fused_adamw=option), _env(optimizers=None), MoEConfig())
        assert not resolved.fused_adamw and "fused_adamw" not in _rows(resolved)


def test_forcing_fused_adamw_against_the_optimizers_is_refused_with_the_fix() -> None:
    needs_ours = (
        r"Execution\(fused_adamw=True\) needs lightning_ep.optim.AdamW, but configure_optimizers returned {}; "
        r"construct lightning_ep.optim.AdamW\(...\) in place of torch.optim.AdamW \(the same arguments and bits\), "
        r"or use fused_adamw='auto'\."
    )
    for optimizers, shown in [
        ((TORCH_ADAMW,), "torch.optim.AdamW"),
        ((KERNEL_ADAMW, TORCH_ADAMW), "lightning_ep.optim.AdamW, torch.optim.AdamW"),
        (("torch.optim.SGD",), "torch.optim.SGD"),
        ((), "no optimizer"),
    ]:
        with pytest.raises(ValueError, match=needs_ours.format(re.escape(shown))):
            resolve(Execution(fused_adamw=True), _env(optimizers=optimizers), MoEConfig())
        early = resolve(Execution(fused_adamw=True), _env(optimizers=None), MoEConfig())
        with pytest.raises(ValueError, match=needs_ours.format(re.escape(shown))):
            with_optimizers(early, Execution(fused_adamw=True), optimizers)
    forced = resolve(Execution(fused_adamw=True), _env(), MoEConfig())
    assert forced.fused_adamw and _rows(forced)["fused_adamw"][1].startswith("forced; lightning_ep.optim.AdamW: ")
    with pytest.raises(
        ValueError,
        match=r"Execution\(fused_adamw=False\), but configure_optimizers returned lightning_ep.optim.AdamW, which "
        r"steps with its kernels on CUDA; return torch.optim.AdamW\(fused=True\) for torch's kernels \(the same "
        r"bits\), or use fused_adamw='auto'\.",
    ):
        resolve(Execution(fused_adamw=False), _env(), MoEConfig())
    # Where the kernels cannot run, lightning_ep.optim.AdamW steps with torch's kernels: False holds.
    cpu = resolve(Execution(fused_adamw=False), _env(device_type="cpu", precision="32-true"), MoEConfig())
    assert _rows(cpu)["fused_adamw"] == ("off", "forced")


def test_optimizer_names_name_the_class_that_steps() -> None:
    from lightning_ep.optim import AdamW

    class Mine(AdamW):
        pass

    class Custom(torch.optim.SGD):
        pass

    params = [torch.nn.Parameter(torch.zeros(4))]
    optimizers = [
        AdamW(params),
        Mine(params),
        torch.optim.AdamW(params, fused=True),
        torch.optim.SGD(params, lr=0.1),
        Custom(params, lr=0.1),
    ]
    assert optimizer_names(optimizers) == (
        KERNEL_ADAMW,
        KERNEL_ADAMW,
        TORCH_ADAMW,
        "torch.optim.SGD",
        f"{__name__}.test_optimizer_names_name_the_class_that_steps.<locals>.Custom",
    )


def test_a_row_budget_pads_the_collective_exchange_and_is_refused_where_it_cannot_apply() -> None:
    """``row_budget`` with the collective exchange: the padded all-to-all, the layers' own
    ``LayerExecution.row_budget`` (``Resolved.layers``), not ``MoEConfig.max_tokens_per_rank`` (the safety
    bound, which the resolution leaves alone)."""
    for budget, sized in (("auto", "sized by the first step, grown to fit"), (4096, "forced")):
        for env in (
            _env(device_type="cpu", devices_per_node=2, degree=2, precision="32-true"),
            _env(num_nodes=2, devices_per_node=8, degree=8),
        ):
            resolved = resolve(Execution(row_budget=budget), env, MoEConfig())
            assert _rows(resolved)["row_budget"] == (
                str(budget),
                f"{sized}; no host sync; a forward over it reruns on the dynamic plan",
            )
            assert resolved.layers == LayerExecution(row_budget=budget) and not resolved.symmetric_memory
            assert not resolved.cuda_graphs  # graphs above degree 1 capture the symmetric-memory plan only
    symm = resolve(
        Execution(exchange="symmetric_memory", row_budget=512), _env(devices_per_node=2, degree=2), MoEConfig()
    )
    assert symm.layers == LayerExecution(exchange="symmetric_memory", row_budget=512)
    with pytest.raises(ValueError, match=r"row_budget='auto'\) sizes the static plan .* degree=1"):
        resolve(Execution(row_budget="auto"), _env(), MoEConfig())
    with pytest.raises(ValueError, match=r"capacity_factor=1.25"):
        resolve(Execution(row_budget=64), _env(devices_per_node=2, degree=2), MoEConfig(capacity_factor=1.25))
    with pytest.raises(
        ValueError, match=r"activation checkpointing \(True\) recomputes the layers inside the backward"
    ):
        resolve(
            Execution(row_budget="auto"), _env(devices_per_node=2, degree=2, activation_checkpointing=True), MoEConfig()
        )


def test_large_experts_keep_graphs_off_for_the_per_expert_backward() -> None:
    """Mixtral-8x7B's experts (2 x 14336 x 4096 elements in one's gate/up weight) on one GPU: no CUDA
    graphs by default, so the backward can run cuBLAS per expert; finer experts keep them, as do
    LoRA experts and a forced choice."""
    mixtral = 2 * 14336 * 4096
    resolved = resolve(Execution(), _env(expert_elements=mixtral), MoEConfig())
    assert not resolved.cuda_graphs and resolved.compile and resolved.fused_adamw
    assert _rows(resolved)["cuda_graphs"] == (
        "off",
        "auto: off for large experts (117 M elements in one's gate/up weight): GPU-bound, and their backward runs "
        "cuBLAS per expert",
    )
    assert not resolved.layers.cuda_graphs
    deepseek_v3 = 2 * 2048 * 7168
    assert resolve(Execution(), _env(expert_elements=deepseek_v3), MoEConfig()).cuda_graphs
    assert resolve(Execution(), _env(expert_elements=mixtral, lora_ranks=(16,)), MoEConfig()).cuda_graphs
    forced = resolve(Execution(cuda_graphs=True), _env(expert_elements=mixtral), MoEConfig())
    assert forced.cuda_graphs and _rows(forced)["cuda_graphs"] == ("on", "forced")
    # Where graphs cannot apply anyway, the table names that reason.
    fp32 = resolve(Execution(), _env(expert_elements=mixtral, precision="32-true"), MoEConfig())
    assert _rows(fp32)["cuda_graphs"] == ("off", "auto: off, needs bf16 experts (precision is 32-true)")


def test_moe_shape_reads_the_model_on_the_meta_device_transformed_or_not() -> None:
    from conftest import tiny_mixtral_config
    from transformers import MixtralForCausalLM

    import lightning_ep
    from lightning_ep.models.registry import MoEShape

    config = tiny_mixtral_config(hidden_size=64, intermediate_size=48)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    want = MoEShape(
        "mixtral", config.num_local_experts, config.num_experts_per_tok, config.num_hidden_layers, 2 * 48 * 64
    )
    assert MoEShape.of(model) == want
    assert MoEShape.of(lightning_ep.transform(model, MoEConfig())) == want
    assert MoEShape.of(torch.nn.Linear(4, 4)) == MoEShape()


def test_the_readme_shows_the_table_of_one_gpu() -> None:
    """The setup table in the README is what one GPU in bf16-mixed prints, line for line, for the
    README's module (its ``configure_optimizers`` returns ``lightning_ep.optim.AdamW``)."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = resolve(Execution(), _env(), MoEConfig()).table()
    assert f"```\n{table}\n```" in readme, table
