"""Worker bodies for the published-layout loads on 2 and 4 gloo processes.

Each rank builds the model the way the strategy does (meta device, ``transform`` on the mesh,
``shard_model``, ``materialize`` with a rank-dependent seed), then ``load_pretrained_sharded`` reads
its own blocks of a published folder. Every full parameter must equal the reference's bit for bit,
and the logits the reference's within 1e-5 (fp32).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from families_workers import family_config, micro_batch, rel_err
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.models.hf_io import load_pretrained_sharded
from lightning_ep.models.init import materialize

RTOL = 1e-5


def sharded(model_type: str, degree: int, replicate: int, rank: int, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(model_type, **overrides))
    mesh = lightning_ep.init_mesh(degree, replicate_degree=replicate, device_type="cpu")
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    torch.manual_seed(1000 + rank)
    materialize(model, "cpu")
    return model.eval()


def load_and_compare(
    rank: int, model_type: str, folder: str, reference: str, degree: int, replicate: int, **overrides
) -> None:
    """Load ``folder`` into a sharded model; compare with the fp32 state dict saved at ``reference``."""
    from transformers import AutoModelForCausalLM

    model = sharded(model_type, degree, replicate, rank, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_pretrained_sharded(model, folder)
    state = torch.load(reference)
    tag = f"{model_type} {Path(folder).name} degree={degree} replicate={replicate} rank {rank}"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (tag, name)
        assert torch.equal(p.full_tensor(), state[name]), (tag, name)
    if model_type == "gpt_oss" and replicate == 1:  # FSDP2 splits the input dim inside MXFP4 groups
        expert = model.get_parameter("model.layers.0.mlp.experts.down_proj")
        _, offset = compute_local_shape_and_global_offset(expert.shape, expert.device_mesh, expert.placements)
        assert offset[1] == (16 if rank >= 2 else 0), (tag, offset)  # ranks 2, 3: rows 16..31 of each expert
    ref = AutoModelForCausalLM.from_config(family_config(model_type, **overrides)).float().eval()
    ref.load_state_dict(state, strict=False)
    ids = micro_batch(0, rank)
    with torch.no_grad():
        err = rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert err <= RTOL, (tag, err)


def run_published(rank: int, world: int, cases: list[tuple[str, str, str, dict]], replicates: list[int]) -> None:
    for replicate in replicates:
        for model_type, folder, reference, overrides in cases:
            load_and_compare(rank, model_type, folder, reference, degree=2, replicate=replicate, **overrides)
