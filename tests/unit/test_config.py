"""``MoEConfig``: SageMaker-v2 defaults, frozenness, and every validation message."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lightning_ep import MoEConfig


def test_defaults_match_sagemaker_v2():
    config = MoEConfig()
    assert config.smp_moe is True
    assert config.random_seed == 12345
    assert config.moe_load_balancing == "sinkhorn"
    assert config.global_token_shuffle is False
    assert config.moe_all_to_all_dispatcher is True
    assert config.moe_aux_loss_coeff == 0.001
    assert config.moe_z_loss_coeff == 0.001


def test_extension_defaults():
    config = MoEConfig()
    assert config.router_dtype == "float32"
    assert config.sinkhorn_iterations == 30
    assert config.balance_update_rate == 0.001


def test_frozen():
    config = MoEConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.moe_load_balancing = "none"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.random_seed = 1  # type: ignore[misc]
    assert config.moe_load_balancing == "sinkhorn"


def test_keyword_only():
    with pytest.raises(TypeError):
        MoEConfig(True)  # type: ignore[misc]


def test_equal_configs_compare_equal_and_replace_validates():
    assert MoEConfig(random_seed=3) == MoEConfig(random_seed=3)
    assert MoEConfig(random_seed=3) != MoEConfig(random_seed=4)
    with pytest.raises(ValueError, match="moe_load_balancing='bogus'"):
        dataclasses.replace(MoEConfig(), moe_load_balancing="bogus")


@pytest.mark.parametrize("mode", ["sinkhorn", "aux_loss", "balanced", "none"])
def test_every_balancing_mode_accepted(mode):
    assert MoEConfig(moe_load_balancing=mode).moe_load_balancing == mode


def test_unknown_balancing_mode_names_field_value_and_choices():
    expected = (
        "MoEConfig.moe_load_balancing='switch' is not supported; "
        "choose one of ['sinkhorn', 'aux_loss', 'balanced', 'none']."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        MoEConfig(moe_load_balancing="switch")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["moe_aux_loss_coeff", "moe_z_loss_coeff", "balance_update_rate"])
def test_negative_coefficient(name):
    with pytest.raises(ValueError, match=re.escape(f"MoEConfig.{name} must be a finite number >= 0, got -0.5.")):
        MoEConfig(**{name: -0.5})


@pytest.mark.parametrize("name", ["moe_aux_loss_coeff", "moe_z_loss_coeff"])
@pytest.mark.parametrize(("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf")])
def test_non_finite_coefficient(name, value, shown):
    with pytest.raises(ValueError, match=re.escape(f"MoEConfig.{name} must be a finite number >= 0, got {shown}.")):
        MoEConfig(**{name: value})


@pytest.mark.parametrize(("value", "shown"), [("0.1", "'0.1' (str)"), (True, "True (bool)")])
def test_coefficient_wrong_type(value, shown):
    with pytest.raises(TypeError, match=re.escape(f"MoEConfig.moe_aux_loss_coeff must be a float, got {shown}.")):
        MoEConfig(moe_aux_loss_coeff=value)  # type: ignore[arg-type]


def test_zero_and_int_coefficients_accepted():
    config = MoEConfig(moe_aux_loss_coeff=0, moe_z_loss_coeff=0.0)
    assert config.moe_aux_loss_coeff == 0 and config.moe_z_loss_coeff == 0.0


@pytest.mark.parametrize(("value", "shown"), [(1.5, "1.5 (float)"), ("7", "'7' (str)"), (True, "True (bool)")])
def test_seed_must_be_int(value, shown):
    expected = f"MoEConfig.random_seed must be an int, got {shown}; pass a whole number >= 0."
    with pytest.raises(TypeError, match=re.escape(expected)):
        MoEConfig(random_seed=value)  # type: ignore[arg-type]


def test_negative_seed():
    with pytest.raises(ValueError, match=re.escape("MoEConfig.random_seed must be >= 0, got -1.")):
        MoEConfig(random_seed=-1)


@pytest.mark.parametrize("name", ["smp_moe", "global_token_shuffle", "moe_all_to_all_dispatcher"])
@pytest.mark.parametrize(("value", "shown"), [(1, "1 (int)"), ("yes", "'yes' (str)"), (None, "None (NoneType)")])
def test_flags_must_be_bool(name, value, shown):
    with pytest.raises(TypeError, match=re.escape(f"MoEConfig.{name} must be a bool, got {shown}.")):
        MoEConfig(**{name: value})


@pytest.mark.parametrize(
    ("name", "spelling"),
    [
        ("token_dedup", "Execution(token_dedup=True)"),
        ("symmetric_memory_dispatch", "Execution(exchange='symmetric_memory', row_budget=N)"),
        ("cuda_graphs", "Execution(cuda_graphs=True)"),
    ],
)
@pytest.mark.parametrize("value", [True, False])
def test_execution_choices_moved_to_execution(name, spelling, value):
    """``lightning_ep.Execution`` is the only home of how a step runs: ``MoEConfig`` refuses its old
    execution fields by name, with the ``Execution`` spelling, whatever their value (a checkpoint
    record that still names them resumes: ``tests/unit/test_config_in_force.py``)."""
    assert name not in {f.name for f in dataclasses.fields(MoEConfig)}
    expected = f"MoEConfig({name}=...) moved to lightning_ep.Execution"
    with pytest.raises(TypeError, match=re.escape(expected) + ".*" + re.escape(spelling)):
        MoEConfig(**{name: value})
    with pytest.raises(TypeError, match=re.escape(expected)):
        dataclasses.replace(MoEConfig(moe_load_balancing="none"), **{name: value})


def test_unknown_router_dtype():
    expected = "MoEConfig.router_dtype='bfloat16' is not supported; choose one of ['float32', 'float64']."
    with pytest.raises(ValueError, match=re.escape(expected)):
        MoEConfig(router_dtype="bfloat16")  # type: ignore[arg-type]
    assert MoEConfig(router_dtype="float64").router_dtype == "float64"


def test_sinkhorn_iterations_at_least_one():
    with pytest.raises(ValueError, match=re.escape("MoEConfig.sinkhorn_iterations must be >= 1, got 0.")):
        MoEConfig(sinkhorn_iterations=0)
    with pytest.raises(TypeError, match=re.escape("MoEConfig.sinkhorn_iterations must be an int, got 2.0 (float)")):
        MoEConfig(sinkhorn_iterations=2.0)  # type: ignore[arg-type]
    assert MoEConfig(sinkhorn_iterations=1).sinkhorn_iterations == 1


@pytest.mark.parametrize(
    ("kwargs", "aux", "z"),
    [
        ({"moe_load_balancing": "aux_loss"}, True, True),
        ({"moe_load_balancing": "aux_loss", "moe_aux_loss_coeff": 0.0}, False, True),
        ({"moe_load_balancing": "sinkhorn"}, False, True),
        ({"moe_load_balancing": "balanced", "moe_z_loss_coeff": 0.0}, False, False),
    ],
)
def test_active_losses(kwargs, aux, z):
    config = MoEConfig(**kwargs)
    assert config.aux_loss_active is aux
    assert config.z_loss_active is z
