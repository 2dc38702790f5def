"""Worker bodies for the Hugging Face interop tests (imported by spawned gloo processes).

Every sharded model here is built the way the strategy builds it: on the meta device, then
``transform(..., mesh=mesh)``, ``shard_model`` and ``materialize`` (seeded differently on each
rank, so that a weight the loader missed could not pass by luck).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from workers import micro_batch, rel_err

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.models.hf_io import export_hf, load_pretrained_sharded
from lightning_ep.models.hf_stored import Opener
from lightning_ep.models.init import materialize

RTOL = 1e-5


def sharded_model(folder: str, degree: int, replicate: int, rank: int) -> nn.Module:
    """A meta-built, transformed, FSDP2-sharded, materialised (random) Mixtral of ``folder``'s config."""
    from transformers import AutoConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(AutoConfig.from_pretrained(folder))
    mesh = lightning_ep.init_mesh(degree, replicate_degree=replicate, device_type="cpu")
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    torch.manual_seed(1000 + rank)
    materialize(model, "cpu")
    return model.eval()


def check_equal_to(model: nn.Module, ref: nn.Module, rank: int, tag: str) -> None:
    """Every full parameter equals ``ref``'s exactly; logits agree to ``RTOL`` (relative)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (tag, name)
        assert torch.equal(p.full_tensor(), ref_params[name]), (tag, name)
    ids = micro_batch(0, rank)
    with torch.no_grad():
        err = rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert err <= RTOL, (tag, err)


def load_and_check(rank: int, folder: str, degree: int, replicate: int) -> nn.Module:
    from transformers import MixtralForCausalLM

    model = sharded_model(folder, degree, replicate, rank)
    load_pretrained_sharded(model, folder)
    ref = MixtralForCausalLM.from_pretrained(folder).eval()
    check_equal_to(model, ref, rank, f"{folder} degree={degree} replicate={replicate}")
    return model


# --------------------------------------------------------------------------------------------
# 2 processes: load at degree 2, export from the live model, write a Lightning-layout DCP
# --------------------------------------------------------------------------------------------


def run_world2(rank: int, world: int, folder: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM, MixtralConfig

    model = load_and_check(rank, folder, degree=2, replicate=1)

    # Change the weights, so that an export of the original folder could not pass.
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(1.5).add_(0.01)
    ids = micro_batch(0, 0)
    with torch.no_grad():
        live_logits = model(input_ids=ids).logits  # collective: every rank runs it

    out_live = Path(out) / "export_live"
    assert export_hf(model, out_live, hf_config_or_folder=folder) == out_live
    if rank == 0:
        exported = AutoModelForCausalLM.from_pretrained(out_live).eval()
        with torch.no_grad():
            err = rel_err(exported(input_ids=ids).logits, live_logits)
        assert err <= RTOL, ("export from the live model", err)
        torch.save({"input_ids": ids, "logits": live_logits}, Path(out) / "live_logits.pt")

    # The checkpoint ModelParallelStrategy.save_checkpoint writes for a LightningModule whose
    # self.model is this model: DCP of {"state_dict": "model." + HF keys, "optimizer_0": ...} + meta.pt.
    holder = nn.Module()
    holder.model = model
    state = get_model_state_dict(holder, options=StateDictOptions(cpu_offload=True))
    assert all(isinstance(v, DTensor) for v in state.values())
    optimizer_state = {"state": {"0": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 1e-3}]}
    dcp.save({"state_dict": state, "optimizer_0": optimizer_state}, checkpoint_id=str(Path(out) / "dcp"))
    if rank == 0:
        torch.save({"epoch": 0, "global_step": 1}, Path(out) / "dcp" / "meta.pt")

    # An error on rank 0 reaches every rank (no rank is left waiting in a barrier).
    wrong = MixtralConfig(**{**model.config.to_dict(), "intermediate_size": 48})
    expected = ValueError if rank == 0 else RuntimeError
    try:
        export_hf(model, Path(out) / "export_wrong", hf_config_or_folder=wrong)
    except expected as err:
        assert "shape mismatches" in str(err), err
        assert rank == 0 or str(err).startswith("export_hf failed on rank 0: ValueError"), err
    else:
        raise AssertionError("export_hf with a wrong config must fail on every rank")

    # A placement that does not hold one contiguous block is refused, naming the parameter.
    mesh = lightning_ep.init_mesh(2, device_type="cpu")
    odd = nn.Module()
    odd.weight = nn.Parameter(
        DTensor.from_local(torch.zeros(2, 4), mesh["shard"], [_StridedShard(0, split_factor=2)], run_check=False)
    )
    try:
        load_pretrained_sharded(odd, folder)
    except ValueError as err:
        assert "'weight' is placed" in str(err) and "lightning_ep.shard_model" in str(err), err
    else:
        raise AssertionError("a _StridedShard parameter must be refused")
    dist.barrier()


# --------------------------------------------------------------------------------------------
# 4 processes: HSDP, uneven shards, and host memory of a sharded load vs a full one
# --------------------------------------------------------------------------------------------


def _proc_field(file: str, field: str) -> int:
    for line in Path(f"/proc/self/{file}").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/{file}")


def _measure(fn) -> int:
    """``fn()``'s peak resident memory above the level before it, in bytes (mapped file pages count)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    rss = _proc_field("status", "VmRSS")
    fn()
    return (_proc_field("status", "VmHWM") - rss) * 1024


def run_world4(rank: int, world: int, tiny: str, uneven: str, big: str | None) -> None:
    from transformers import MixtralForCausalLM

    load_and_check(rank, tiny, degree=2, replicate=2)  # HSDP: (Replicate, Shard) placements
    load_and_check(rank, uneven, degree=2, replicate=1)  # 6 experts, vocab 130: uneven and empty shards
    if big is None:
        return

    model = sharded_model(big, degree=2, replicate=1, rank=rank)  # each rank holds about 1/4 of it
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    share_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    default = Opener.MAPPED_BYTES
    try:
        Opener.MAPPED_BYTES = 0  # unmap after every block: the peak is then one block's pages and copy
        peak = _measure(lambda: load_pretrained_sharded(model, big))
        Opener.MAPPED_BYTES = 2 << 20  # a file stays mapped until 2 MiB were read through it
        budget_peak = _measure(lambda: load_pretrained_sharded(model, big))
    finally:
        Opener.MAPPED_BYTES = default
    holder: list[nn.Module] = []
    full_peak = _measure(lambda: holder.append(MixtralForCausalLM.from_pretrained(big)))
    print(f"rank {rank}: model {model_bytes}, share {share_bytes}, peak +{peak}, +{budget_peak}, full +{full_peak}")
    assert full_peak >= 0.9 * model_bytes, ("the measurement must see a full load", full_peak, model_bytes)
    assert peak <= 0.1 * model_bytes, ("host memory beyond the rank's own shards", peak, model_bytes)
    # Pages mapped around each read (the kernel maps whole folios) stay within a few times the budget.
    assert budget_peak <= 4 * (2 << 20) + 0.1 * model_bytes, ("mapped pages beyond the budget", budget_peak)
    # Still exact: each local shard equals the same block of the full model.
    ref_params = dict(holder[0].named_parameters())
    for name, p in model.named_parameters():
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        block = ref_params[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        assert torch.equal(p.to_local(), block), name
