"""``lightning_ep.plan``: counts from configs, layouts as the strategy checks them, the degree
``"auto"`` chooses (numbers worked out by hand below), the no-fit message, and the command line.
Exactness against sharded models is ``tests/distributed/test_plan_exact.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_mixtral_config

from lightning_ep.parallel.mesh import check_layout
from lightning_ep.plan import Layout, Workload, choose_layout, model_shape, plan_layouts, rank_params, valid_layouts
from lightning_ep.plan.auto import node_local_degree, plan_for_devices
from lightning_ep.plan.memory import rank_memory, state_bytes
from lightning_ep.plan.model import with_lora

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import FAMILY_NAMES, family_config

MIB = 2**20


def test_every_family_is_counted_as_built() -> None:
    from transformers import AutoModelForCausalLM

    for model_type in ("mixtral", *FAMILY_NAMES):
        config = tiny_mixtral_config() if model_type == "mixtral" else family_config(model_type)
        shape = model_shape(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert shape.total_params == sum(p.numel() for p in model.parameters()), model_type
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert shape.expert_params == experts, model_type
        assert (shape.num_experts, shape.top_k, shape.hidden) == (8, 2, 64), model_type


def test_valid_layouts_are_the_strategy_s() -> None:
    for world in range(1, 13):
        listed = {(p.degree, p.replicate_degree) for p in valid_layouts(world, 8)}
        for degree in range(1, world + 1):
            for replicate in range(1, world + 1):
                try:
                    check_layout(world, degree, replicate)
                    ok = 8 % degree == 0
                except ValueError:
                    ok = False
                assert ((degree, replicate) in listed) == ok, (world, degree, replicate)


def test_rank_zero_holds_the_most_and_shards_add_up() -> None:
    shape = model_shape(tiny_mixtral_config())
    for world, degree, replicate in [(2, 1, 1), (4, 2, 1), (4, 2, 2), (6, 2, 1), (3, 1, 1)]:
        layout = Layout(world=world, degree=degree, replicate_degree=replicate)
        per_rank = [rank_params(shape, layout, r).total for r in range(world)]
        assert per_rank[0] == max(per_rank)
        # Every rank of one replica together holds the model exactly once.
        assert sum(per_rank[: layout.shard]) == shape.total_params, (world, degree, replicate)


# A tiny Mixtral whose experts dominate: H 64, F 4096, E 8, 2 layers, V 128, seq 8 (activations and the
# expert GEMMs' temporaries stay under 3 MiB).
# Experts: 2 layers x 8 x 3 x 64 x 4096 = 12,582,912 elements; dense 66,560 (embed, head, 2 x attention
# 4 x 64 x 64 = 16,384, router 512, norms). Under 32-true each element costs 16 bytes at rest (params,
# grads, 2 AdamW states), sharded over all 4 ranks (FSDP2, or 2 of 8 experts per rank at degree 4): ~48.3 MiB
# per rank at any degree. The degree sets what FSDP2 gathers per layer: one layer's E/d experts, 6,291,456 / d
# elements, in fp32 = 24 MiB / d; in backward the plan holds this layer's and the prefetched one's (2 x) plus
# the unsharded gradient and its fp32 reduce-scatter copy (2 x): 96 / d MiB. At degree 4 = world size FSDP2
# leaves the experts alone (shard_model): nothing gathered. Needs: d=1 ~144 MiB, d=2 ~96, d=4 ~48.
BIG_EXPERTS = dict(intermediate_size=4096)
WORKLOAD = Workload(micro_batch=1, seq=8, precision="32-true")


@pytest.mark.parametrize(
    ("memory_mib", "degree"),
    [(200, 1), (120, 2), (60, 4)],  # 90% usable: 180 >= 144; 144 > 108 >= 96; 96 > 54 >= 48
)
def test_auto_chooses_the_smallest_degree_that_fits(memory_mib: int, degree: int) -> None:
    shape = model_shape(tiny_mixtral_config(**BIG_EXPERTS))
    plan = choose_layout(shape, 4, WORKLOAD, memory_bytes=memory_mib * MIB, gpus_per_node=4)
    assert (plan.layout.degree, plan.layout.replicate_degree) == (degree, 1)
    need = 16 * shape.total_params / 4 + (96 * MIB / degree if degree < 4 else 0)
    assert 0 <= plan.memory.total - need < 3 * MIB, (plan.memory.total / MIB, need / MIB)


def test_no_layout_fits_names_what_would() -> None:
    shape = model_shape(tiny_mixtral_config(**BIG_EXPERTS))
    # 4 GPUs of 40 MiB (36 usable) fit nothing (d=4 needs ~48 MiB); 8 GPUs at degree 8 need ~24 MiB
    # (an eighth of the states, nothing gathered): the smallest world size that fits.
    with pytest.raises(ValueError, match=r"no layout of 4 GPUs fits mixtral .* It would fit on 8 GPUs \(degree=8"):
        choose_layout(shape, 4, WORKLOAD, memory_bytes=40 * MIB, gpus_per_node=4)
    with pytest.raises(ValueError, match=r"or on GPUs with at least 5\d\.\d MiB \(degree=4, replicate_degree=1 needs"):
        choose_layout(shape, 4, WORKLOAD, memory_bytes=40 * MIB, gpus_per_node=4)


def test_the_strategy_s_choice_on_cuda_and_on_cpu() -> None:
    # CUDA: the plan with the strategy's replicate degree; CPU: the node-local rule, unchanged.
    plan = plan_for_devices(
        tiny_mixtral_config(**BIG_EXPERTS),
        world_size=4,
        devices_per_node=4,
        replicate_degree=1,
        memory_bytes=120 * MIB,
        precision="32-true",
        micro_batch=1,
        seq=8,
        activation_checkpointing=False,
        capacity_factor=None,
    )
    assert plan.layout.degree == 2
    assert node_local_degree(8, 4, 8, 1) == 4
    assert node_local_degree(6, 4, 4, 1) == 2
    assert node_local_degree(8, 4, 4, 4) == 1


def test_lora_with_frozen_fp8_experts_fits_a_mixtral_8x7b_on_one_80_gib_gpu() -> None:
    """A Mixtral-8x7B (MixtralConfig's defaults, 46.7 B parameters) under LoRA of rank 16 at degree 1 on one
    80 GiB GPU: with its experts in bf16 no layout fits (94 GB of weights alone); kept in FP8 one does,
    the experts holding 1.0002 bytes an element; in MXFP4 fewer still."""
    from transformers import MixtralConfig

    config = MixtralConfig()
    kwargs = dict(world_size=1, devices_per_node=1, replicate_degree=1, memory_bytes=80 * 2**30)
    run = dict(precision="bf16-true", micro_batch=1, seq=4096, activation_checkpointing=True, capacity_factor=None)
    with pytest.raises(ValueError, match="or on GPUs with at least"):
        plan_for_devices(config, **kwargs, **run, lora_rank=16)  # type: ignore[arg-type]
    fp8 = plan_for_devices(config, **kwargs, **run, lora_rank=16, frozen_experts="fp8")  # type: ignore[arg-type]
    mxfp4 = plan_for_devices(config, **kwargs, **run, lora_rank=16, frozen_experts="mxfp4")  # type: ignore[arg-type]
    assert fp8.layout.degree == 1
    shape = model_shape(config)
    experts = shape.expert_params
    lora = Workload(precision="bf16-true", lora_rank=16)
    params, grads, optimizer = state_bytes(shape, Layout(world=1, degree=1), lora)
    fp8_workload = Workload(precision="bf16-true", lora_rank=16, frozen_experts="fp8")
    fp8_params, fp8_grads, _ = state_bytes(shape, Layout(world=1, degree=1), fp8_workload)
    assert params - fp8_params == experts * 2 - (experts + 4 * experts // (128 * 128))
    assert grads == fp8_grads < shape.total_params // 100  # the adapters only
    assert optimizer == 2 * grads + 4 * sum(p.trainable for p in with_lora(shape, 16).params)
    assert mxfp4.memory.params < fp8.memory.params < 49e9  # 45.1 G experts at 1 byte, 1.6 G dense at 2, the adapters
    # A folder's own FP8 block (llm-compressor's groups of 128: blocks of 1 x 128) holds a scale per 128 values.
    grouped = plan_for_devices(config, **kwargs, **run, lora_rank=16, frozen_experts="fp8", fp8_block=(1, 128))  # type: ignore[arg-type]
    assert grouped.memory.params - fp8.memory.params == 4 * (experts // 128 - experts // (128 * 128))


def test_workload_refuses_frozen_experts_without_lora() -> None:
    with pytest.raises(
        ValueError, match=r"frozen_experts='fp8'\): pass one of \['fp8', 'mxfp4', 'nf4'\] with a lora_rank >= 1"
    ):
        Workload(frozen_experts="fp8")
    with pytest.raises(ValueError, match=r"lora_rank=-1"):
        Workload(lora_rank=-1)
    with pytest.raises(ValueError, match=r"Workload\(fp8_block=\(0, 128\)\): pass \(rows, cols\), two ints >= 1"):
        Workload(fp8_block=(0, 128))


def test_checkpointing_and_capacity_change_activations_as_stated() -> None:
    shape = model_shape(tiny_mixtral_config())
    layout = Layout(world=4, degree=4)
    base = dict(micro_batch=2, seq=64, precision="bf16-mixed")
    plain = rank_memory(shape, layout, Workload(**base))  # type: ignore[arg-type]
    ac = rank_memory(shape, layout, Workload(**base, activation_checkpointing=True))  # type: ignore[arg-type]
    keep = rank_memory(shape, layout, Workload(**base, activation_checkpointing="keep_all_to_all"))  # type: ignore[arg-type]
    capped = rank_memory(shape, layout, Workload(**base, capacity_factor=1.0))  # type: ignore[arg-type]
    assert ac.activations < keep.activations < plain.activations
    assert plain.activations < plain.activations_worst  # every token of 4 ranks choosing this rank's experts
    assert capped.activations == capped.activations_worst  # a capacity is a static bound


def test_command_line_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    tiny_mixtral_config().to_json_file(config)
    out = subprocess.run(
        [sys.executable, "-m", "lightning_ep.plan", "--config", str(config), "--gpus", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    layouts = {(r["degree"], r["replicate_degree"]) for r in records}
    assert layouts == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    shape = model_shape(tiny_mixtral_config())
    for r in records:
        layout = Layout(world=4, degree=r["degree"], replicate_degree=r["replicate_degree"])
        assert r["params_per_rank"] == rank_params(shape, layout).total
        assert set(r["bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
        assert r["fits"] is True and r["step_time_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0"], "--gpus=0: pass an int >= 1"),
        (["--gpus", "4", "--degree", "3"], "--degree=3: pass a divisor of --gpus=4"),
        (["--gpus", "4", "--gpu-memory", "12XB"], "--gpu-memory='12XB': pass a size such as 141GiB"),
        (["--gpus", "4", "--frozen-experts", "fp8"], "--frozen-experts=fp8: the experts are frozen under LoRA; pass"),
        (["--gpus", "4", "--lora-rank", "-2"], "--lora-rank=-2: pass 0 (a full fine-tune) or a rank >= 1"),
    ],
)
def test_command_line_errors(tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from lightning_ep.plan.__main__ import run

    config = tmp_path / "config.json"
    tiny_mixtral_config().to_json_file(config)
    assert run(["--config", str(config), *args]) == 2
    assert message in capsys.readouterr().err


def test_command_line_error_exits_2_without_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_ep.plan", "--config", str(tmp_path / "missing.json"), "--gpus", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--config=" in out.stderr and "no such file" in out.stderr and "Traceback" not in out.stderr


def test_plans_of_one_layout_only() -> None:
    shape = model_shape(tiny_mixtral_config())
    plans = plan_layouts(shape, 8, WORKLOAD, degree=2, replicate_degree=2)
    assert [(p.layout.degree, p.layout.replicate_degree, p.layout.edp) for p in plans] == [(2, 2, 2)]
