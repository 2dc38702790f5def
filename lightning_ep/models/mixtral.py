"""Mixtral (``MixtralSparseMoeBlock``): softmax -> top-k -> renormalise, optional input jitter,
fused SwiGLU experts ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``. On disk, Mixtral
checkpoints keep per-expert keys (``block_sparse_moe.experts.N.w1/w2/w3``); transformers fuses them
on load and splits them on save (its ``conversion_mapping``); ``models.hf_io`` reads those files
through the same rules, one rank's rows at a time.
"""

from lightning_ep.models.registry import MoEFamily, register

MIXTRAL = register(
    MoEFamily(
        name="mixtral",
        model_types=("mixtral",),
        block_classes=("MixtralSparseMoeBlock",),
        router_weight="gate.weight",
        gate_up_proj="experts.gate_up_proj",
        down_proj="experts.down_proj",
        top_k="num_experts_per_tok",
        activation="hidden_act",
        jitter="router_jitter_noise",
        normalize_weights=True,
    )
)
