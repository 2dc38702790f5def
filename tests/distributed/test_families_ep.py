"""Every supported Hugging Face MoE family at expert-parallel degree 2 on 2 gloo processes.

One spawn runs all families (see ``families_workers.check_family_degree2``): ``transform(mesh=...)``
and ``shard_model`` give the loss and every full gradient of data parallelism of the untouched
model (1e-5, fp32); ``load_pretrained_sharded`` fills a sharded model from ``save_pretrained``
files (per-expert keys fused on the fly, GPT-OSS's fused tensors and biases sharded alike); and
``export_hf`` of the sharded model loads back with ``from_pretrained`` with equal logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from families_workers import FAMILY_NAMES, run_families, run_families_dedup
from harness import spawn

pytestmark = pytest.mark.distributed


def test_families_at_degree_2(tmp_path: Path) -> None:
    spawn(run_families, 2, list(FAMILY_NAMES), str(tmp_path))


def test_families_with_token_dedup() -> None:
    spawn(run_families_dedup, 2, list(FAMILY_NAMES))
