"""Tiny models of every supported Hugging Face MoE family, and the gloo worker that checks them.

Imported by spawned processes and by ``tests/unit/test_families.py``. Every model is fp32, hidden
64, 8 experts, top-2, vocab 128, its dims multiples of 8, with the selection and expert biases
that Hugging Face initialises to zero filled with random values, so that each of them matters.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_ep
from lightning_ep import LayerExecution, MoEConfig
from lightning_ep.moe.dispatch.dedup import DedupAllToAllDispatcher

VOCAB = 128
RTOL = 1e-5
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
)
# model_type -> (config class name, fields). Between them: softmax routing with and without
# norm_topk_prob, a gated shared expert and a dense layer (qwen2_moe), sigmoid routing with a
# correction bias, groups, scaling with and without renormalisation, shared experts and a first
# dense layer (deepseek_v3, glm4_moe), top-k-then-softmax with router and expert biases (gpt_oss).
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            head_dim=16,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, norm_topk_prob=False),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            intermediate_size=48,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            head_dim=16,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, head_dim=16),
    ),
}
FAMILY_NAMES = tuple(FAMILY_CONFIGS)
# model_type -> (HF sparse block class, number of sparse blocks, the dense MLP class left alone or None)
BLOCKS: dict[str, tuple[str, int, str | None]] = {
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", 2, "Qwen2MoeMLP"),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", 2, None),
    "olmoe": ("OlmoeSparseMoeBlock", 2, None),
    "deepseek_v3": ("DeepseekV3MoE", 2, "DeepseekV3MLP"),
    "glm4_moe": ("Glm4MoeMoE", 2, "Glm4MoeMLP"),
    "gpt_oss": ("GptOssMLP", 2, None),
}


def family_config(model_type: str, **overrides: Any):
    import transformers

    class_name, fields = FAMILY_CONFIGS[model_type]
    return getattr(transformers, class_name)(**{**COMMON, **fields, **overrides})


def tiny_family(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A freshly initialised fp32 ``*ForCausalLM`` of ``model_type``, in train mode; equal seeds
    give equal weights. Zero-initialised biases (DeepSeek's correction bias, GPT-OSS's expert
    biases) are drawn at random too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(model_type, **overrides)).float()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.05)  # sigmoid scores spread ~0.03 here: it changes the choices
            elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                tensor.normal_(0.0, 0.1)
    return model.train()


def micro_batch(step: int, rank: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


CONFIG = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0, moe_aux_loss_coeff=0.0)


def check_family_grads(
    rank: int, world: int, model_type: str, device: str = "cpu", execution: LayerExecution | None = None
) -> tuple[nn.Module, Any]:
    """At degree 2: loss and every full gradient equal the data-parallel reference (the untouched
    one-process model fed each rank's micro-batch, averaged). Returns the reference and the mesh."""
    execution = execution if execution is not None else LayerExecution()
    tag = f"{model_type} rank {rank} {device} token_dedup={execution.token_dedup}"
    reference = tiny_family(model_type).to(device)
    model = copy.deepcopy(reference)
    mesh = lightning_ep.init_mesh(2, device_type=torch.device(device).type)
    lightning_ep.transform(model, CONFIG, mesh=mesh, execution=execution)
    assert all(
        isinstance(layer.dispatcher, DedupAllToAllDispatcher) is execution.token_dedup
        for layer in lightning_ep.moe_layers(model)
    ), tag
    lightning_ep.shard_model(model, mesh)

    # The reference accumulates every rank's micro-batch, divided by the world size.
    ref_loss = 0.0
    for r in range(world):
        ids = micro_batch(0, r).to(device)
        loss = reference(input_ids=ids, labels=ids).loss / world
        loss.backward()
        ref_loss += loss.item()
    ids = micro_batch(0, rank).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    assert abs(mean_loss.item() / world - ref_loss) <= RTOL * abs(ref_loss), (tag, mean_loss.item() / world, ref_loss)
    ref_params = dict(reference.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(ref_params), (tag, "parameter names changed")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (tag, name, "not sharded")
        assert p.shape == ref_params[name].shape, (tag, name)
        assert p.grad is not None, (tag, name, "no gradient")
        err = rel_err(full(p.grad), ref_params[name].grad)
        assert err <= RTOL, (tag, name, err)
    return reference, mesh


def check_family_degree2(rank: int, world: int, model_type: str, out: Path) -> None:
    """``check_family_grads``; then a ``save_pretrained`` folder loads into a freshly sharded model
    with ``load_pretrained_sharded``, and ``export_hf`` writes a folder that ``from_pretrained``
    loads with the sharded model's logits."""
    from transformers import AutoModelForCausalLM

    from lightning_ep.models.hf_io import export_hf, load_pretrained_sharded

    tag = f"{model_type} rank {rank}"
    reference, mesh = check_family_grads(rank, world, model_type)
    # Sharded loading: a differently seeded sharded model takes the reference's saved weights.
    folder = out / f"{model_type}_hf"
    if rank == 0:
        reference.save_pretrained(folder)
    dist.barrier()
    loaded = tiny_family(model_type, seed=1)
    lightning_ep.transform(loaded, CONFIG, mesh=mesh)
    lightning_ep.shard_model(loaded, mesh)
    load_pretrained_sharded(loaded, folder)
    ref_state = reference.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(full(value), ref_state[key]), (tag, "load_pretrained_sharded", key)

    # Export of the live sharded model (its weights changed), loaded back on rank 0.
    with torch.no_grad():
        for p in loaded.parameters():
            p.to_local().mul_(1.5).add_(0.01)
    loaded.eval()
    ids = micro_batch(1, 0)
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits  # collective: every rank runs it
    exported = export_hf(loaded, out / f"{model_type}_export", hf_config_or_folder=folder)
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(exported).eval()
        with torch.no_grad():
            err = rel_err(reloaded(input_ids=ids).logits, logits)
        assert err <= RTOL, (tag, "export_hf then from_pretrained", err)
    dist.barrier()


def run_families(rank: int, world: int, model_types: list[str], out: str) -> None:
    for model_type in model_types:
        check_family_degree2(rank, world, model_type, Path(out))


def run_families_dedup(rank: int, world: int, model_types: list[str]) -> None:
    """``check_family_grads`` with ``LayerExecution(token_dedup=True)``: shared experts run while the
    deduplicated rows travel, and the families' routers (grouped, biased, softmax after top-k) feed it."""
    for model_type in model_types:
        check_family_grads(rank, world, model_type, execution=LayerExecution(token_dedup=True))


def run_families_cuda(rank: int, world: int, model_types: list[str]) -> None:
    """``check_family_grads`` under NCCL, one GPU per rank (fp32: the experts' per-expert loop)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for model_type in model_types:
        check_family_grads(rank, world, model_type, device=f"cuda:{rank}")
