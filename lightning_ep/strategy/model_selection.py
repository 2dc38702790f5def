"""Which parts of a LightningModule ``ExpertParallelStrategy`` parallelises, and how it treats the rest.

- **The MoE model**: the Hugging Face model with MoE blocks that gets expert parallelism and FSDP2,
  named by its attribute path (``ExpertParallelStrategy(moe_model="policy")``) or, when there is
  only one, found.
- **Other MoE models** (a frozen reference model, as in DPO or RL fine-tunes): kept as they are,
  whole on every rank, with their own MoE blocks (no expert parallelism, no communication). They
  must have no trainable parameter: a trainable one would train on each rank apart and drift.
- **Extra trainable modules** outside those models (a value head): FSDP2 over the whole mesh, one
  unit each (``parallel.fsdp.shard_dense_modules``), so their gradients are averaged over every rank.
  FSDP2 gathers a module's weights in its ``forward``: call the module, not its weights. A trainable
  parameter held directly by a module that also holds an MoE model cannot be sharded and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_ep.models.registry import family_for, find_moe_blocks
from lightning_ep.transform import moe_layers


@dataclass(frozen=True)
class Selection:
    """The MoE ``model`` at attribute ``path`` of the LightningModule, the ``others`` (``{path: model}``,
    left whole on every rank) and the ``extras`` (``{path: module}``, to shard with FSDP2)."""

    path: str
    model: nn.Module
    others: dict[str, nn.Module] = field(default_factory=dict)
    extras: dict[str, nn.Module] = field(default_factory=dict)


def _is_moe_model(module: nn.Module, smp_moe: bool) -> bool:
    """A Hugging Face model with MoE blocks (or, with ``smp_moe=False``, with decoder layers to shard)."""
    if moe_layers(module):
        return True
    if smp_moe:
        return bool(find_moe_blocks(module, family_for(module)))  # family_for refuses unsupported families
    return bool(getattr(module, "_no_split_modules", None))


def moe_model_candidates(module: nn.Module, smp_moe: bool) -> dict[str, nn.Module]:
    """``{attribute path: model}`` of the outermost MoE models inside ``module``; ``ValueError`` if none
    (naming the Hugging Face models found, or the unsupported family)."""
    candidates: dict[str, nn.Module] = {}
    hf_models: list[str] = []
    family_error: ValueError | None = None
    for path, sub in module.named_modules():
        if any(path.startswith(p + ".") for p in candidates):
            continue  # inside a model already found (MixtralForCausalLM.model)
        if not hasattr(getattr(sub, "config", None), "model_type"):
            continue
        hf_models.append(type(sub).__name__)
        try:
            if _is_moe_model(sub, smp_moe):
                candidates[path] = sub
        except ValueError as error:  # an unsupported family: an error only if no model qualifies
            family_error = family_error or error
    if candidates:
        return candidates
    if family_error is not None:
        raise family_error
    raise ValueError(
        f"ExpertParallelStrategy found no MoE block in {type(module).__name__}: build a supported Hugging Face "
        "MoE model (e.g. MixtralForCausalLM) as an attribute of the LightningModule in configure_model(); "
        f"found {hf_models or 'no Hugging Face model'}."
    )


def select(module: nn.Module, moe_model: str | None, *, smp_moe: bool) -> Selection:
    """Find the MoE model (``moe_model``: its attribute path, or ``None`` for the only one), the other
    MoE models and the extra trainable modules of ``module``; ``ValueError`` for no MoE model, several
    and none named, ``moe_model`` naming none, another with trainable parameters, or a trainable
    parameter directly on a module holding an MoE model.
    """
    candidates = moe_model_candidates(module, smp_moe)
    if moe_model is None:
        if len(candidates) > 1:
            raise ValueError(
                f"ExpertParallelStrategy(moe_model=None): {type(module).__name__} holds {len(candidates)} MoE "
                f"models, at {list(candidates)}; name the one to parallelise by its attribute path, e.g. "
                f"ExpertParallelStrategy(moe_model={next(iter(candidates))!r}). The others must be frozen "
                "(requires_grad_(False)): they stay whole on every rank."
            )
        path = next(iter(candidates))
    elif moe_model in candidates:
        path = moe_model
    else:
        raise ValueError(
            f"ExpertParallelStrategy(moe_model={moe_model!r}): {type(module).__name__} has no MoE model at that "
            f"attribute path; its MoE models are at {list(candidates)}."
        )
    others = {p: m for p, m in candidates.items() if p != path}
    for other_path, other in others.items():
        trainable = sum(p.numel() for p in other.parameters() if p.requires_grad)
        if trainable:
            raise ValueError(
                f"ExpertParallelStrategy(moe_model={path!r}): the other MoE model at {other_path!r} has {trainable} "
                "trainable parameters, which would train apart on each rank (it is not parallelised); freeze it "
                f"in configure_model ({other_path}.requires_grad_(False)) to keep it whole on every rank, or train "
                "it in a run of its own."
            )
    return Selection(path, candidates[path], others, _extras(module, [path, *others]))


def _extras(module: nn.Module, models: list[str]) -> dict[str, nn.Module]:
    """The largest submodules with trainable parameters that hold none of ``models`` (paths)."""
    containers = {p.rpartition(".")[0] if "." in p else "" for p in models}
    for path in list(containers):
        while path:
            path = path.rpartition(".")[0]
            containers.add(path)
    extras: dict[str, nn.Module] = {}
    loose: list[str] = []

    def walk(path: str, sub: nn.Module) -> None:
        if path in models:
            return
        if path not in containers:
            if any(p.requires_grad for p in sub.parameters()):
                extras[path] = sub
            return
        prefix = f"{path}." if path else ""
        loose.extend(prefix + n for n, p in sub.named_parameters(recurse=False) if p.requires_grad)
        for name, child in sub.named_children():
            walk(prefix + name, child)

    walk("", module)
    if loose:
        raise ValueError(
            f"ExpertParallelStrategy cannot shard the trainable parameters {loose}: they sit directly on a module "
            "that also holds the MoE model, and FSDP2 shards whole modules (gathering their weights in forward). "
            "Move them into a submodule whose forward uses them (e.g. an nn.Linear, or a small nn.Module), which "
            "the strategy then shards over all ranks."
        )
    return extras
