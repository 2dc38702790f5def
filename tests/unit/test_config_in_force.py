"""No MoE configuration is silently ignored (one process): ``transform`` on a transformed model and
``config_differences`` with its ``EXECUTION_FIELDS`` rule. The strategy's refusal through the
Trainer: ``tests/trainer/test_resume.py``."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest
from conftest import tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.config import EXECUTION_FIELDS, config_differences


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
        r"MoEConfig, which stays in force: moe_load_balancing='aux_loss' \(asked: 'balanced'\), token_dedup=False "
        r"\(asked: True\). A model is transformed once; drop one of the two transform\(\) calls, or pass both the "
        r"same MoEConfig."
    )
    with pytest.raises(ValueError, match=message):
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="balanced", token_dedup=True))
    with pytest.raises(ValueError, match=r"which stays in force: smp_moe=True \(asked: False\)"):
        lightning_ep.transform(model, MoEConfig(smp_moe=False))
    assert all(layer.config.moe_load_balancing == "aux_loss" for layer in lightning_ep.moe_layers(model))


def test_execution_fields_are_the_only_ones_that_may_differ() -> None:
    base = MoEConfig()
    assert set(EXECUTION_FIELDS) < {f.name for f in fields(MoEConfig)}
    execution = MoEConfig(moe_all_to_all_dispatcher=True, token_dedup=True, max_tokens_per_rank=64)
    assert config_differences(base, execution, math_only=True) == {}
    assert config_differences(base, execution) == {"max_tokens_per_rank": (None, 64), "token_dedup": (False, True)}
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
