"""Hugging Face interop on 2 and 4 gloo processes.

- ``load_pretrained_sharded``: a tiny Mixtral saved with ``save_pretrained`` (several safetensors
  files with an index, or one file) is loaded into meta-built, transformed, FSDP2-sharded models
  at degree 2 (2 ranks), degree 2 with replicate 2 (HSDP, 4 ranks) and degree 2 on 4 ranks with
  6 experts and vocabulary 130 (uneven and empty dense shards). Every ``full_tensor()`` equals the
  saved parameter exactly and the logits agree within 1e-5. With a 27 MB model in four shard files
  on 4 ranks, each rank's peak host memory during the load (``VmHWM`` after a reset, so mapped file
  pages count) stays under 0.1 of the model when each block is unmapped after its read, and within a
  few times ``Opener.MAPPED_BYTES`` when files stay mapped up to that budget, while
  ``from_pretrained`` of the full model needs at least 0.9.
- ``export_hf``: from the live sharded model (2 ranks; rank 0 writes) and from a Lightning-layout
  DCP directory written by those ranks (read here on one process, no process group): the folder
  loads with ``from_pretrained`` with logits equal (1e-5) to the trained model's, and its on-disk
  keys are exactly those ``save_pretrained`` of the original Hugging Face model wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import spawn
from hf_io_workers import run_world2, run_world4
from workers import rel_err, tiny_mixtral

from lightning_ep.models.hf_io import export_hf

pytestmark = pytest.mark.distributed

CAN_MEASURE = Path("/proc/self/clear_refs").exists()


def disk_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def test_world2_load_export_live_and_from_dcp(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    tiny_mixtral(seed=7).save_pretrained(folder, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    spawn(run_world2, 2, str(folder), str(tmp_path))

    live = torch.load(tmp_path / "live_logits.pt")
    original_keys = disk_keys(folder)
    assert disk_keys(tmp_path / "export_live") == original_keys

    out = export_hf(tmp_path / "dcp", tmp_path / "export_dcp", hf_config_or_folder=folder)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        err = rel_err(exported(input_ids=live["input_ids"]).logits, live["logits"])
    assert err <= 1e-5
    assert disk_keys(out) == original_keys
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()


def test_world4_hsdp_uneven_shards_and_host_memory(tmp_path: Path) -> None:
    tiny, uneven, big = tmp_path / "tiny", tmp_path / "uneven", tmp_path / "big"
    tiny_mixtral(seed=1).save_pretrained(tiny)
    tiny_mixtral(seed=2, num_local_experts=6, vocab_size=130).save_pretrained(uneven)
    if CAN_MEASURE:
        big_model = tiny_mixtral(
            seed=3, hidden_size=256, intermediate_size=128, num_local_experts=16, num_hidden_layers=4
        )
        big_model.save_pretrained(big, max_shard_size="8MB")
        del big_model
    spawn(run_world4, 4, str(tiny), str(uneven), str(big) if CAN_MEASURE else None)
