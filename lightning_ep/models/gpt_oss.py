"""GPT-OSS (``GptOssMLP``): the router (child ``router``, with a logit ``bias``) takes the top-k of
its logits, then the softmax over those ``K``; experts in the transposed, interleaved layout with
biases and the clamped SwiGLU (``InterleavedGLUExperts``). Checkpoints store the fused tensors
under their in-memory names; OpenAI's releases store the experts in MXFP4 (``*_blocks`` /
``*_scales``, ``[E, out, in/32, 16]``), which ``models.hf_io`` dequantizes and transposes.
"""

from __future__ import annotations

import torch

from lightning_ep.models.registry import MoEFamily, register
from lightning_ep.moe.layer import MoELayer


class GptOssMoELayer(MoELayer):
    """``MoELayer`` returning a pair, as ``GptOssDecoderLayer`` unpacks ``hidden, _ = self.mlp(hidden)``;
    the second item (Hugging Face's router scores, which every caller discards) is ``None``."""

    def forward(self, hidden_BSH: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(hidden_BSH), None


GPT_OSS = register(
    MoEFamily(
        name="gpt_oss",
        model_types=("gpt_oss",),
        block_classes=("GptOssMLP",),
        router_weight="router.weight",
        router_bias="router.bias",
        scoring="topk_softmax",
        normalize_weights=False,
        expert_layout="interleaved",
        layer_class=GptOssMoELayer,
    )
)
