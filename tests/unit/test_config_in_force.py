"""No MoE configuration is silently ignored (one process): ``transform`` on a transformed model,
the ``EXECUTION_FIELDS`` rule (records of older releases included), the checkpoint record's check,
and the bias keys of an allowed balancing switch. The same refusals through the Trainer:
``tests/trainer/test_resume.py``."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch
from conftest import tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.checkpoint.records import check_record, make_record, moe_shape, saved_bias_keys
from lightning_ep.moe.config import ABSENT, EXECUTION_FIELDS, MOVED_TO_EXECUTION, config_differences

PATH = Path("runs/last.ckpt")


def test_transform_again_with_the_same_config_keeps_the_layers() -> None:
    config = MoEConfig(moe_load_balancing="aux_loss")
    model = lightning_ep.transform(tiny_mixtral(), config)
    layers = lightning_ep.moe_layers(model)
    assert lightning_ep.transform(model, MoEConfig(moe_load_balancing="aux_loss")) is model
    assert lightning_ep.moe_layers(model) == layers


def test_transform_again_with_another_config_is_refused() -> None:
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="aux_loss"))
    message = (
        r"transform\(model, config\): the model's MoE layers were already built by transform\(\) with another "
        r"MoEConfig, which stays in force: moe_load_balancing='aux_loss' \(asked: 'balanced'\), "
        r"max_tokens_per_rank=None \(asked: 64\). A model is transformed once; drop one of the two transform\(\) "
        r"calls, or pass both the same MoEConfig."
    )
    with pytest.raises(ValueError, match=message):
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="balanced", max_tokens_per_rank=64))
    with pytest.raises(ValueError, match=r"which stays in force: smp_moe=True \(asked: False\)"):
        lightning_ep.transform(model, MoEConfig(smp_moe=False))
    assert all(layer.config.moe_load_balancing == "aux_loss" for layer in lightning_ep.moe_layers(model))


def test_execution_fields_are_the_only_ones_that_may_differ() -> None:
    base = MoEConfig()
    names = {f.name for f in fields(MoEConfig)}
    # The execution fields MoEConfig still has, and those that moved to Execution (older records name them).
    assert set(EXECUTION_FIELDS) == {"moe_all_to_all_dispatcher", "max_tokens_per_rank", *MOVED_TO_EXECUTION}
    assert {"moe_all_to_all_dispatcher", "max_tokens_per_rank"} < names and not set(MOVED_TO_EXECUTION) & names
    guarded = MoEConfig(max_tokens_per_rank=64)
    assert config_differences(base, guarded, math_only=True) == {}
    assert config_differences(base, guarded) == {"max_tokens_per_rank": (None, 64)}
    assert config_differences(base, MoEConfig(moe_all_to_all_dispatcher=False), math_only=True) == {}
    # Every other field changes the math.
    for name, value in (("random_seed", 1), ("router_dtype", "float64"), ("global_token_shuffle", True)):
        assert config_differences(base, MoEConfig(**{name: value}), math_only=True) == {
            name: (asdict(base)[name], value)
        }


def test_a_record_of_another_version_compares_by_defaults() -> None:
    old = asdict(MoEConfig(moe_load_balancing="none"))
    del old["sinkhorn_iterations"]  # written before the field existed: its default
    assert config_differences(old, MoEConfig(moe_load_balancing="none")) == {}
    assert config_differences(old, MoEConfig(moe_load_balancing="none", sinkhorn_iterations=5)) == {
        "sinkhorn_iterations": (30, 5)
    }
    newer = {**old, "some_future_field": 3}
    assert repr(config_differences(newer, MoEConfig(moe_load_balancing="none"))) == (
        "{'some_future_field': (3, <no such field>)}"
    )


def test_a_record_with_the_fields_that_moved_to_execution_still_resumes() -> None:
    """A checkpoint of an older release records ``token_dedup``, ``symmetric_memory_dispatch`` and
    ``cuda_graphs`` in its ``moe_config``: they changed how the math ran, not the math, so they differ
    (from fields this ``MoEConfig`` lacks) but are never refused; the math is still checked."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none"))
    now = MoEConfig(moe_load_balancing="none")
    for value in (False, True):
        record = make_record(now, model)
        record["moe_config"] |= dict.fromkeys(MOVED_TO_EXECUTION, value)
        assert config_differences(record["moe_config"], now, math_only=True) == {}
        assert config_differences(record["moe_config"], now) == {name: (value, ABSENT) for name in MOVED_TO_EXECUTION}
        check_record(record, now, model, allowed=(), path=PATH)
    record["moe_config"]["moe_load_balancing"] = "sinkhorn"
    with pytest.raises(ValueError, match=r"another MoE configuration: MoEConfig.moe_load_balancing='sinkhorn' "):
        check_record(record, now, model, allowed=(), path=PATH)


def test_check_record_refuses_by_name_and_allows_by_name() -> None:
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="balanced"))
    record = make_record(MoEConfig(moe_load_balancing="sinkhorn", balance_update_rate=0.01), model)
    assert record["moe_shape"] == {"model_type": "mixtral", "num_experts": 8, "top_k": 2, "num_moe_layers": 2}
    assert moe_shape(tiny_mixtral()) == record["moe_shape"]  # the same before transform
    now = MoEConfig(moe_load_balancing="balanced", max_tokens_per_rank=64)  # an execution field: never refused
    message = (
        r"checkpoint 'runs/last.ckpt' was saved with another MoE configuration: "
        r"MoEConfig.moe_load_balancing='sinkhorn' \(this run: 'balanced'\), MoEConfig.balance_update_rate=0.01 "
        r"\(this run: 0.001\), the model's top_k=4 \(this run: 2\). Resume with the MoEConfig and model it was saved "
        r"with; to change them on purpose \(e.g. another balancing mode for the next phase of training\), pass "
        r"ExpertParallelStrategy\(allow_moe_config_change=\['moe_load_balancing', 'balance_update_rate', 'top_k'\]\)."
    )
    record["moe_shape"]["top_k"] = 4
    with pytest.raises(ValueError, match=message):
        check_record(record, now, model, allowed=(), path=PATH)
    with pytest.raises(ValueError, match=r"another MoE configuration: MoEConfig.balance_update_rate=0.01"):
        check_record(record, now, model, allowed=("moe_load_balancing", "top_k"), path=PATH)
    check_record(record, now, model, allowed=("moe_load_balancing", "balance_update_rate", "top_k"), path=PATH)
    check_record(None, now, model, allowed=(), path=PATH)  # saved before the record existed: no check


@pytest.mark.parametrize(("saved", "now"), [("balanced", "sinkhorn"), ("none", "balanced")])
def test_saved_bias_keys_match_the_checkpoint_while_loading(saved: str, now: str) -> None:
    """An allowed balancing switch loads strictly: the routers show the checkpoint's bias keys while
    loading, and their own afterwards (a new ``"balanced"`` bias keeps its zeros)."""
    source = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing=saved))
    state = source.state_dict()
    model = lightning_ep.transform(tiny_mixtral(seed=1), MoEConfig(moe_load_balancing=now))
    own = set(model.state_dict())
    layers = lightning_ep.moe_layers(model)
    with saved_bias_keys(make_record(MoEConfig(moe_load_balancing=saved), source), layers):
        assert set(model.state_dict()) == set(state)
        model.load_state_dict(state, strict=True)
    assert set(model.state_dict()) == own
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    if now == "balanced":
        assert all(torch.count_nonzero(layer.gate.expert_bias) == 0 for layer in layers)


def test_execution_given_by_hand_and_another_by_the_strategy_is_refused() -> None:
    from lightning_ep import LayerExecution
    from lightning_ep.transform import check_execution_in_force

    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(), execution=LayerExecution(cuda_graphs=True))
    check_execution_in_force(model, LayerExecution(cuda_graphs=True))  # the same choices: accepted
    with pytest.raises(ValueError, match=r"given LayerExecution\(cuda_graphs=True.*drop transform\(\)'s execution="):
        check_execution_in_force(model, LayerExecution())
    # Layers left at the defaults take the strategy's choices.
    check_execution_in_force(lightning_ep.transform(tiny_mixtral(), MoEConfig()), LayerExecution(cuda_graphs=True))
