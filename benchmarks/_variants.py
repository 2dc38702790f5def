"""Benchmark variants: run a row on the hot-path code that a change replaced, so that the change is
measured against it in the same process (``bench_layer --variants``, ``bench_step --rows ep:a2a@VARIANT``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lightning_ep.models import causal_mask
from lightning_ep.moe import GroupedExperts, MoELayer, RoutedExperts
from lightning_ep.moe.dispatch import all_gather as dispatch_ag
from lightning_ep.moe.dispatch import all_to_all as dispatch_ep
from lightning_ep.moe.dispatch import base as dispatch
from lightning_ep.moe.dispatch import combine, rows
from lightning_ep.moe.dispatch import dedup as dispatch_dedup
from lightning_ep.moe.dispatch.static import symm_pull
from lightning_ep.moe.dispatch.static import symmetric as dispatch_symm
from lightning_ep.moe.experts import grouped as experts
from lightning_ep.moe.experts import mlp as grouped_mlp
from lightning_ep.moe.graphs import GraphedLayer
from lightning_ep.moe.kernels import swiglu
from lightning_ep.moe.routing import router
from lightning_ep.parallel import compile as compiling
from lightning_ep.parallel import fsdp
from lightning_ep.strategy import expert_parallel as strategy_module
from lightning_ep.strategy import step_checks

VARIANTS = (
    "fast",
    "unfused-swiglu",
    "unfused-combine",
    "sync-counts",
    "atomic-bwd",
    "grouped-experts",
    "root-head",
    "eager-loss",
    "eager-head",
    "eager-norm",
    "dedup",
    "wide-sort-keys",
    "unfused-copy-sum",
    "unfolded-scale",
    "unfused-backward",
    "reference",
    "serial-shared",
    "padded-rows",
    "torch-sinkhorn",
    "torch-cast",
    "device-logging",
    "unrouted-graphs",
    "hf-mask",
    "grouped-backward",
    "widened-wgrad",
    "fsdp-one-rank",
)

_SWIGLU, _SWIGLU_BACKWARD = swiglu.swiglu, swiglu.swiglu_backward


def _bincount_sort(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = expert_ids_TK.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _bincount_ids(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


def _index_select_permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


def _index_select_gather(
    x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int, inverse_N: torch.Tensor | None = None
) -> torch.Tensor:
    return x_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))


def _bmm_unsort(
    y_NH: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = weights_TK.shape
    y_TKH = y_NH.index_select(0, inverse_N).view(num_tokens, top_k, -1)
    return torch.bmm(weights_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1)


def _swiglu_every_row(h_NF: torch.Tensor, act_fn: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
    return _SWIGLU(h_NF, act_fn)


def _swiglu_backward_every_row(
    h_NF: torch.Tensor, grad_NI: torch.Tensor, act_fn: Any, scale: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _SWIGLU_BACKWARD(h_NF, grad_NI, act_fn, scale)


def _torch_cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype)


def _torch_widen(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return grad.to(dtype)


def _copy_every_row(dst_MH: torch.Tensor, src_MH: torch.Tensor, src_M: torch.Tensor) -> None:
    dst_MH.copy_(src_MH)


def _sum_copies_by_gather(x_NH: torch.Tensor, inverse_N: torch.Tensor, top_k: int) -> torch.Tensor:
    return x_NH.index_select(0, inverse_N).view(-1, top_k, x_NH.shape[1]).sum(dim=1)


_SHARD_MODEL = fsdp.shard_model


def _shard_through_fsdp2(*args: Any, in_place_on_one_rank: bool = False, **kwargs: Any) -> Any:
    return _SHARD_MODEL(*args, **kwargs)


_QUEUE_TO_HOST, _BEFORE_STEP = step_checks._queue_to_host, step_checks.StepChecks.before_optimizer_step
_DEVICE_VALUES: list[torch.Tensor] = []


def _queue_keeping_device(values: torch.Tensor) -> Any:
    _DEVICE_VALUES.append(values)
    return _QUEUE_TO_HOST(values)


def _log_device_tensors(self: Any, module: Any) -> None:
    """``StepChecks.before_optimizer_step`` with the losses averaged and logged on the device."""
    values = list(_DEVICE_VALUES)
    _DEVICE_VALUES.clear()
    log_losses, self.log_losses = self.log_losses, False
    try:
        _BEFORE_STEP(self, module)  # waits for the forward's copy; raises on a flag
    finally:
        self.log_losses = log_losses
    if not values or module is None or not log_losses:
        return
    n = len(self._layers)
    total = values[0][: 2 * n]
    for v in values[1:]:
        total = total + v[: 2 * n]
    aux, z = total[:n] / len(values), total[n:] / len(values)
    module.log_dict({"moe/aux_loss": aux.sum(), "moe/z_loss": z.sum()}, prog_bar=True, on_step=True, on_epoch=False)
    per_layer = {f"moe/layer_{i}/aux_loss": aux[i] for i in range(n)}
    module.log_dict(per_layer | {f"moe/layer_{i}/z_loss": z[i] for i in range(n)}, on_step=True, on_epoch=False)


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Swap replaced implementations back in for the duration (benchmark only):

    - ``unfused-swiglu``: ``silu(gate) * up`` under autograd instead of the Triton kernel;
    - ``unfused-combine``: the combine's torch fallback instead of the Triton kernel;
    - ``sync-counts``: counts per expert by ``torch.bincount`` (reads the maximum back to the host);
    - ``atomic-bwd``: permutations and the combine by ``index_select`` + ``bmm`` under plain
      autograd (zero-fill + scatter-add backward, outer-product GEMM);
    - ``grouped-experts``: the grouped GEMM even where the experts would pick one cuBLAS GEMM per
      expert (``GroupedExperts.per_expert_min_gflop = None``);
    - ``root-head``: the output projection stays in the root's FSDP2 unit (``shard_model``), not
      in one of its own;
    - ``eager-loss``: ``Execution(compile=True)`` / ``+compile`` leave the loss function eager;
    - ``eager-head``: they leave the output projection and the final norm eager (``compile_head``);
    - ``eager-norm``: they leave the final norm before it eager (``compile_final_norm``);
    - ``dedup``: nothing patched here; ``bench_layer`` sets the all-to-all dispatcher's ``dedup``
      (``LayerExecution(token_dedup=True)``; ``bench_step`` has the row option ``+dedup`` for it,
      ``Execution(token_dedup=True)``);
    - ``wide-sort-keys``: expert ids sorted as int64 keys (8 radix passes on CUDA), not narrowed;
    - ``unfused-copy-sum``: the dispatch's backward sums a token's K gradient copies by a gather
      into ``[T, K, H]`` and a sum, not the one-pass kernel (``combine.sum_copies``);
    - ``unfolded-scale``: the grouped experts under plain autograd, the gradient scale applied by
      two passes over ``[N, H]`` gradients (``with_grad_scale``), not folded (``grouped_mlp``);
    - ``unfused-backward``: the last three together (the backward before they were made, commit 4892753);
    - ``reference``: all of the above (the code before these changes);
    - ``serial-shared``: nothing patched here; ``bench_layer`` sets the layer's
      ``overlap_shared = False`` (shared experts after the dispatch exchange, not during it);
    - ``padded-rows``: a static plan's padding rows copied into the symmetric buffer and run
      through the SwiGLU kernels like the received ones, and rows pulled in blocks of 1024
      elements (the earlier symmetric-memory dispatch);
    - ``torch-sinkhorn``: Sinkhorn's iterations in torch (about a dozen launches each), not the fused
      kernels (one launch in all, ``lightning_ep.moe.kernels.sinkhorn``);
    - ``torch-cast``: the experts' fp32 weights' bf16 gradients widened by torch's copy loop, not the
      Triton kernel (``lightning_ep.moe.kernels.cast``; bf16-mixed with the experts outside FSDP2);
    - ``device-logging``: the MoE losses logged as device tensors, which Lightning reads back for
      the progress bar at every batch end (the non-finite flags still read from their host copy),
      not as the CPU tensors copied after each forward (``lightning_ep.strategy.step_checks``);
    - ``unrouted-graphs``: the CUDA graphs start at the dispatch at degree 1 too, the routing run
      before them by the host (``GraphedLayer.take_routing``);
    - ``hf-mask``: every forward builds its attention mask through Hugging Face's
      ``create_causal_mask`` (one host sync per forward), not only those whose mask is not known on
      the host (``lightning_ep.models.causal_mask``);
    - ``grouped-backward``: the backward of a grouped forward runs the grouped GEMMs, widening fp32
      masters' bf16 gradients, not one cuBLAS GEMM per large expert on the forward's counts copied
      to the host, writing fp32 (``GroupedExperts.counts_for_backward``);
    - ``widened-wgrad``: the grouped backward's weight gradients for fp32 masters as the grouped
      GEMM's bf16 widened by a second pass, not written in fp32 by one Triton kernel
      (``lightning_ep.moe.kernels.grouped_wgrad``);
    - ``fsdp-one-rank``: at world size 1 the dense parameters go through FSDP2 (gathered parameters
      kept from forward to backward, gradients reduced in their dtype), not used in place
      (``lightning_ep.parallel.single_rank``).
    """
    patches: dict[str, Any] = {}
    if name in ("unfused-swiglu", "reference"):
        patches |= {"fused_swiglu_available": lambda h: False}
    if name in ("unfused-combine", "reference"):
        patches |= {"fused_combine_available": lambda y: False}
    if name in ("sync-counts", "reference"):
        patches |= {"sort_by_expert": _bincount_sort, "count_ids": _bincount_ids}
    if name in ("atomic-bwd", "reference"):
        patches |= {
            "permute_rows": _index_select_permute,
            "gather_rows": _index_select_gather,
            "weighted_unsort": _bmm_unsort,
        }
    if name in ("grouped-experts", "reference"):
        patches |= {"per_expert_min_gflop": None}
    if name in ("root-head", "reference"):
        patches |= {"output_head": lambda model: None}
    if name in ("eager-loss", "reference"):
        patches |= {"compile_loss": lambda model, **kwargs: False}
    if name in ("eager-head", "reference"):
        patches |= {"compile_head": lambda model, **kwargs: False}
    if name in ("eager-norm", "reference"):
        patches |= {"compile_final_norm": lambda model, **kwargs: False}
    if name in ("wide-sort-keys", "unfused-backward", "reference"):
        patches |= {"narrow_keys": lambda keys, bound: keys}
    if name in ("unfused-copy-sum", "unfused-backward", "reference"):
        patches |= {"sum_copies": _sum_copies_by_gather}
    if name in ("unfolded-scale", "unfused-backward", "reference"):
        patches |= {"fold_grad_scale": lambda *args: False}
    if name == "padded-rows":
        patches |= {
            "swiglu": _swiglu_every_row,
            "swiglu_backward": _swiglu_backward_every_row,
            "copy_live_rows": _copy_every_row,
            "MOVE_BLOCK_H": 1024,
        }
    if name == "torch-sinkhorn":
        patches |= {"fused_sinkhorn_available": lambda logits: False}
    if name == "torch-cast":
        patches |= {"cast_for_compute": _torch_cast, "widen": _torch_widen}
    if name in ("grouped-backward", "reference"):
        patches |= {"counts_for_backward": lambda self, x_NH, counts_L, w_first: None}
    if name in ("widened-wgrad", "reference"):
        patches |= {"grouped_weight_grad_available": lambda g, b: False}
    if name == "device-logging":
        patches |= {"_queue_to_host": _queue_keeping_device, "before_optimizer_step": _log_device_tensors}
    if name == "unrouted-graphs":
        patches |= {"take_routing": lambda self, tokens, z_weight_T: False}
    if name in ("hf-mask", "reference"):
        patches |= {"mask_is_known": lambda config, args, kwargs: False}
    if name in ("fsdp-one-rank", "reference"):
        patches |= {"shard_model": _shard_through_fsdp2}
    modules = (
        combine,
        router,
        dispatch,
        rows,
        dispatch_ep,
        dispatch_ag,
        dispatch_dedup,
        dispatch_symm,
        experts,
        grouped_mlp,
        swiglu,
        symm_pull,
        GroupedExperts,
        RoutedExperts,
        fsdp,
        compiling,
        step_checks,
        step_checks.StepChecks,
        MoELayer,
        GraphedLayer,
        causal_mask,
        strategy_module,
    )
    saved = [(m, k, getattr(m, k)) for m in modules for k in patches if k in vars(m)]
    for module, key, _ in saved:
        setattr(module, key, patches[key])
    try:
        yield
    finally:
        for module, key, value in saved:
            setattr(module, key, value)
