"""Worker bodies for the multi-process tests (imported by spawned processes).

The reference everywhere is data parallelism of the unsharded model: the one-process model fed
each rank's micro-batch, losses and gradients averaged over ranks.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_ep
from lightning_ep import LayerExecution, MoEConfig
from lightning_ep.moe.dispatch.dedup import DedupAllToAllDispatcher

VOCAB = 128
SEQ = 16
BATCH = 2
RTOL = 1e-5


def tiny_mixtral(seed: int = 0, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**fields)).float()


def micro_batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclass(frozen=True)
class Case:
    degree: int
    replicate: int = 1
    mode: str = "none"
    all_to_all: bool = True
    shuffle: bool = False
    skew: bool = False
    steps: int = 2
    clip: float | None = None
    device: str = "cpu"  # "cuda" runs one GPU per rank under NCCL (tests/gpu)
    dtype: str = "float32"
    rtol: float = RTOL
    capacity: float | None = None
    policy: str = "probs"
    budget: int | None = None  # MoEConfig.max_tokens_per_rank; with symm, LayerExecution.row_budget instead
    per_expert: bool = False  # the experts run one GEMM per expert on the dispatcher's host counts
    tied: bool = False  # lm_head shares the input embedding's weight
    dedup: bool = False  # LayerExecution.token_dedup
    symm: bool = False  # LayerExecution(exchange="symmetric_memory") (CUDA only)
    top_k: int = 2

    def config(self) -> MoEConfig:
        return MoEConfig(
            moe_load_balancing=self.mode,  # type: ignore[arg-type]
            moe_all_to_all_dispatcher=self.all_to_all,
            global_token_shuffle=self.shuffle,
            moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=0.001,
            capacity_factor=self.capacity,
            drop_policy=self.policy,  # type: ignore[arg-type]
            max_tokens_per_rank=None if self.symm else self.budget,
        )

    def execution(self) -> LayerExecution:
        """How the expert-parallel model's layers run (the reference runs on one process, locally)."""
        return LayerExecution(
            exchange="symmetric_memory" if self.symm else "collective",
            token_dedup=self.dedup,
            row_budget=self.budget if self.symm else None,
        )


def _skew_router(model: torch.nn.Module) -> None:
    """Every token picks experts 0 and 1 (held by EP rank 0); the other experts get no token."""
    from lightning_ep.moe.routing.router import Routing

    def hook(gate, _inputs, routing):
        ids_TK = torch.tensor([0, 1], device=routing.expert_ids_TK.device).expand_as(routing.expert_ids_TK)
        weights_TK = routing.probs_TE.gather(1, ids_TK)
        return Routing(routing.logits_TE, routing.probs_TE, ids_TK, weights_TK / weights_TK.sum(-1, keepdim=True))

    for layer in lightning_ep.moe_layers(model):
        layer.gate.register_forward_hook(hook)


def _check_host_counts(_experts: torch.nn.Module, args: tuple) -> None:
    """The dispatcher handed the experts its host copy of the counts (so the per-expert GEMMs need
    no sync of their own), and it is right."""
    _x_MH, counts_L, counts_host = args
    assert counts_host is not None and counts_host == counts_L.tolist(), (counts_host, counts_L)


def run_case(rank: int, world: int, case: Case) -> None:
    """Two AdamW steps under transform + shard_model vs the reference, asserting equality."""
    device = torch.device(case.device, rank) if case.device == "cuda" else torch.device("cpu")
    base = tiny_mixtral(tie_word_embeddings=case.tied, num_experts_per_tok=case.top_k)
    base = base.to(device=device, dtype=getattr(torch, case.dtype))
    config = case.config()
    ref_config = replace(config, global_token_shuffle=False) if case.shuffle else config
    ref = lightning_ep.transform(copy.deepcopy(base), ref_config)
    model = copy.deepcopy(base)
    mesh = lightning_ep.init_mesh(case.degree, replicate_degree=case.replicate, device_type=device.type)
    lightning_ep.transform(model, config, mesh=mesh, execution=case.execution())
    if case.per_expert:
        for layer in lightning_ep.moe_layers(model):
            layer.experts.use_grouped_mm = False
            layer.experts.register_forward_pre_hook(_check_host_counts)
    if case.all_to_all and case.capacity is None and case.degree > 1 and not case.symm:
        assert all(
            isinstance(layer.dispatcher, DedupAllToAllDispatcher) is case.dedup
            for layer in lightning_ep.moe_layers(model)
        ), case
    lightning_ep.shard_model(model, mesh)
    # An untied lm_head is an FSDP2 unit of its own; a tied one stays in the root's.
    assert isinstance(model.lm_head, FSDPModule) is not case.tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is case.tied
    rtol = case.rtol
    if case.skew:
        _skew_router(ref)
        _skew_router(model)
    ref.train()
    model.train()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    for layer in lightning_ep.moe_layers(ref):
        layer.loss_scale = 1.0 / world  # the reference accumulates `world` micro-batches
    ref_names = dict(ref.named_parameters())
    tag = f"{case} rank {rank}"
    for step in range(case.steps):
        # Reference: every rank's micro-batch through the one-process model, averaged.
        opt_ref.zero_grad()
        ref_loss = 0.0
        for r in range(world):
            ids = micro_batch(step, r).to(device)
            loss = ref(input_ids=ids, labels=ids).loss / world
            loss.backward()
            ref_loss += loss.item()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip or float("inf"))

        opt.zero_grad()
        ids = micro_batch(step, rank).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        assert abs(mean_loss.item() - ref_loss) <= rtol * abs(ref_loss), (
            tag,
            step,
            mean_loss.item(),
            ref_loss,
        )

        norm = lightning_ep.clip_grad_norm_(model.parameters(), case.clip or float("inf"))
        assert abs(norm.item() - ref_norm.item()) <= rtol * ref_norm.item(), (
            tag,
            step,
            norm.item(),
            ref_norm.item(),
        )
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), (tag, name)
            assert p.grad is not None, (tag, name, "missing gradient")
            err = rel_err(full(p.grad), ref_names[name].grad)
            assert err <= rtol, (tag, step, name, err)
        if case.capacity is not None and case.capacity < 1:
            dropped = sum(int(layer.tokens_dropped) for layer in lightning_ep.moe_layers(model))
            assert dropped > 0, (tag, "capacity below 1 must drop some tokens")
        if case.skew:
            for layer in lightning_ep.moe_layers(model):
                grad = full(layer.experts.gate_up_proj.grad)
                assert torch.all(grad[2:] == 0), (tag, "experts without tokens must get an all-zero gradient")
                assert grad[:2].abs().sum() > 0
        opt_ref.step()
        opt.step()
    for name, p in model.named_parameters():
        err = rel_err(full(p.detach()), ref_names[name].detach())
        assert err <= rtol, (tag, "after AdamW", name, err)
    with torch.no_grad():  # evaluation: every unit, the lm_head's included, is sharded again after it
        model(input_ids=micro_batch(0, rank).to(device))
    assert all(isinstance(p, DTensor) for p in model.parameters()), tag


def run_cases(rank: int, world: int, cases: list[Case]) -> None:
    for case in cases:
        run_case(rank, world, case)


def run_meta_init(rank: int, world: int, degree: int, replicate: int) -> None:
    """A model built on meta, transformed, sharded, then materialised: sane and consistent."""
    from transformers import MixtralForCausalLM

    from lightning_ep.models.init import materialize

    config = tiny_mixtral().config
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    mesh = lightning_ep.init_mesh(degree, replicate_degree=replicate, device_type="cpu")
    lightning_ep.transform(model, MoEConfig(), mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    torch.manual_seed(0)
    materialize(model, "cpu")
    replicate_group = mesh["replicate"].get_group()
    for name, p in model.named_parameters():
        local = p.to_local()
        assert local.device.type == "cpu" and torch.isfinite(local).all(), name
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            assert torch.all(local == 1), name
        else:
            std = float(full(p.detach()).std())
            assert abs(std - config.initializer_range) < 0.2 * config.initializer_range, (name, std)
        # HSDP replicas must hold identical shards.
        copies = [torch.empty_like(local) for _ in range(replicate)]
        dist.all_gather(copies, local.contiguous(), group=replicate_group)
        assert all(torch.equal(c, copies[0]) for c in copies), (name, "replicas differ")
    inv_freq = model.model.rotary_emb.inv_freq
    assert torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    ids = micro_batch(0, rank)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5


def _seeded_loss(seed: int, rank: int) -> tuple[float, torch.Tensor]:
    model = tiny_mixtral(router_jitter_noise=0.1)
    mesh = lightning_ep.init_mesh(2, device_type="cpu")
    config = MoEConfig(random_seed=seed, global_token_shuffle=True, moe_load_balancing="none")
    lightning_ep.transform(model, config, mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    model.train()
    ids = micro_batch(0, rank)
    rng_before = torch.random.get_rng_state()
    losses = [model(input_ids=ids, labels=ids).loss.item() for _ in range(2)]
    assert torch.equal(rng_before, torch.random.get_rng_state()), "MoE layers touched the global RNG"
    assert losses[0] != losses[1], "each step must draw new jitter and a new permutation"
    return losses[0], torch.tensor(losses)


def run_seeded(rank: int, world: int) -> None:
    """Same seed: identical runs; other seed: different; jitter differs between EP ranks."""
    a, seq_a = _seeded_loss(7, rank)
    _, seq_b = _seeded_loss(7, rank)
    c, _ = _seeded_loss(8, rank)
    assert torch.equal(seq_a, seq_b), (seq_a, seq_b)
    assert a != c


def run_bad_degree(rank: int, world: int) -> None:
    import pytest

    model = tiny_mixtral(num_local_experts=6)
    mesh = lightning_ep.init_mesh(4, device_type="cpu")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "degree=4 does not divide the number of experts 6 (layer 0); choose a degree that divides both the "
            "expert count and the world size 4: one of [1, 2]. Otherwise use an expert count that is a multiple "
            "of 4, or a world size / replicate_degree that is a multiple of one of [3, 6] to use it as the degree."
        ),
    ):
        lightning_ep.transform(model, MoEConfig(), mesh=mesh)
    # Under HSDP a degree must divide the ranks of one replica, W / replicate_degree = 2 here.
    hybrid = lightning_ep.init_mesh(2, replicate_degree=2, device_type="cpu")
    with pytest.raises(ValueError, match=re.escape("and world size / replicate_degree = 2: one of [1]. Otherwise")):
        lightning_ep.transform(tiny_mixtral(num_local_experts=3), MoEConfig(), mesh=hybrid)
    plain = lightning_ep.transform(tiny_mixtral(), MoEConfig())
    with pytest.raises(
        RuntimeError, match=r"call lightning_ep.transform\(model, config, mesh=mesh\) before shard_model"
    ):
        lightning_ep.shard_model(plain, mesh)


def run_experts_outside_fsdp(rank: int, world: int) -> None:
    """degree = world: the experts are left out of FSDP2 (their mesh ``edp`` has one rank) and cast to
    the policy's bf16 themselves; losses, gradients and parameters after AdamW are bitwise those of
    FSDP2-wrapped experts (which on one rank only copy and cast)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = tiny_mixtral()
    models, optimizers = [], []
    for shard_experts in (True, None):
        model = copy.deepcopy(base)
        mesh = lightning_ep.init_mesh(world, device_type="cpu")
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="aux_loss"), mesh=mesh)
        lightning_ep.shard_model(model, mesh, mp_policy=policy, shard_experts=shard_experts)
        for layer in lightning_ep.moe_layers(model):
            assert isinstance(layer.experts, FSDPModule) == bool(shard_experts)
            assert layer.experts.compute_dtype == (None if shard_experts else torch.bfloat16)
            assert layer.experts.gate_up_proj.dtype == torch.float32
        model.train()
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    for step in range(2):
        ids = micro_batch(step, rank)
        losses = []
        for model, opt in zip(models, optimizers, strict=True):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        wrapped, plain = (dict(m.named_parameters()) for m in models)
        assert list(wrapped) == list(plain)
        for name, p in plain.items():
            assert p.grad.dtype == torch.float32, name
            assert torch.equal(full(p.grad), full(wrapped[name].grad)), (step, name)
        for opt in optimizers:
            opt.step()
    wrapped, plain = (dict(m.named_parameters()) for m in models)
    for name, p in plain.items():
        assert torch.equal(full(p.detach()), full(wrapped[name].detach())), name
