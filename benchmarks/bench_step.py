"""A full training step (forward, backward, AdamW) of a truncated Mixtral through the Lightning
Trainer: this library against the baselines, same GPUs, same run.

Rows (``--rows``, run one after another in this process; each builds its own Trainer):

- ``eager``: Hugging Face blocks, ``experts_implementation="eager"``, under Lightning's
  ``ModelParallelStrategy`` with ``fully_shard`` on every decoder layer and the root in
  ``configure_model`` (FSDP2, bf16 parameters, fp32 gradient reduction).
- ``grouped_mm``: the same with ``experts_implementation="grouped_mm"``.
- ``hf_ep``: transformers' own expert parallelism as the installed version offers it. On 5.17:
  ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=W, enable_expert_parallel=True))``
  (experts split over a ``tp`` mesh, the router masks other ranks' experts, outputs all-reduced;
  attention replicated, so all ranks share one batch of ``batch * W`` sequences), under
  ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=W)``, ``AdamW(foreach=False)``
  (``foreach=True`` fails on its mixed Tensor/DTensor parameters).
- ``ep:a2a`` / ``ep:allgather``: ``lightning_ep.ExpertParallelStrategy(degree=W)`` with the
  all-to-all or all-gather dispatcher (degree 1 when run on one GPU) and ``Execution()``: the
  automatic choices a user gets with no flag (printed in the row's setup table); ``ep:symm`` the
  dropless exchange pulled through CUDA symmetric memory (``Execution(exchange="symmetric_memory")``).
  Options appended to a row (they combine: ``ep:a2a+compile+zero2``): ``+eager`` forces every
  execution choice off (no compile, CUDA graphs or single-rank FSDP2; the optimizer is the row's, whose
  kernels ``Execution.fused_adamw`` reports); ``+compile``, ``+graph``,
  ``+dedup`` force ``Execution(compile=True)``, ``cuda_graphs=True``, ``token_dedup=True``, and
  ``+nograph`` forces ``cuda_graphs=False``, so that a ``--trace`` ties every kernel to its host op (on a
  baseline row ``+compile`` applies ``compile_blocks`` to every decoder layer, its MoE block
  included, ``compile_loss`` and ``compile_head``; ``+compile_dense`` the dense parts only); ``+budget``
  (``ep:symm``, ``ep:a2a`` above degree 1) sets ``Execution(row_budget=ceil(--row-budget x batch x
  seq x top_k))``, a static plan free of host syncs (on ``ep:a2a`` the padded all-to-all),
  ``+autobudget`` ``row_budget="auto"``; ``+adamw`` steps with ``lightning_ep.optim.AdamW`` whatever
  ``--optimizer`` says; ``+prefetch`` sets FSDP2 forward/backward prefetch of the next decoder layer
  explicitly; ``+ac`` checkpoints every decoder layer (``activation_checkpointing=True``),
  ``+ac_keep`` keeping the MoE layers' exchanges (``"keep_all_to_all"``); ``+zero2`` keeps gathered
  parameters from forward to backward (``reshard_after_forward=False``), ``+zero3`` forces
  ``Execution(single_rank_fsdp=False)`` (on one GPU FSDP2 frees them after forward and reduces in
  fp32, as on several); ``+monitor`` adds
  ``lightning_ep.MoEMonitor(every_n_steps=1, plots=False)`` (its worst case); ``+manualgc`` turns
  Python's garbage collector off during the fit and collects the young generations every 5 steps;
  ``+none``, ``+aux_loss``, ``+sinkhorn`` and ``+balanced`` set the row's balancing mode instead of
  ``--balancing``; ``+lora`` trains PEFT LoRA adapters only (``peft.get_peft_model`` in
  ``configure_model``: rank 16, alpha 32, on ``q/k/v/o_proj`` and on ``experts.gate_up_proj`` /
  ``experts.down_proj`` through ``target_parameters``; on ``eager`` / ``grouped_mm`` rows that is HF
  + PEFT under FSDP2, on ``ep:`` rows this library's expert-stacked adapters); ``+fp8`` / ``+mxfp4`` /
  ``+nf4`` (``ep:`` rows with ``+lora``) keep the frozen expert weights in that format
  (``ExpertParallelStrategy(frozen_experts=...)``); ``+fp8gemm`` (``ep:`` rows without ``+lora``) runs
  the trainable experts' GEMMs in FP8 (``ExpertParallelStrategy(expert_gemms="fp8")``); ``@reference`` (or
  another of ``_variants.VARIANTS``) runs it on the replaced hot-path code.

Each rank processes ``batch * seq`` tokens per step (``hf_ep``: the shared batch counts once, over
``W`` GPUs). Reported per GPU: tokens/s, model TFLOP/s (``_common.model_flops_per_token``),
MFU against a dense bf16 GEMM timed in this process, peak memory allocated, and the first step's
seconds (compilation and CUDA-graph warm-up included: what a user waits before training runs).

    torchrun --nproc-per-node 2 benchmarks/bench_step.py --shape coarse --rows eager grouped_mm ep:a2a ep:allgather
    python benchmarks/bench_step.py --shape fine --rows ep:a2a grouped_mm+lora ep:a2a+lora   # LoRA beside full FT
    python benchmarks/bench_step.py --shape coarse --rows ep:a2a    # one GPU: this library at degree 1
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    SHAPES,
    Shape,
    add_record_args,
    dense_gemm_tflops,
    log,
    markdown_table,
    model_flops_per_token,
    rank,
    report,
    world,
)
from _variants import VARIANTS, variant


def hf_config(shape: Shape, seq: int) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        max_position_embeddings=seq,
        output_router_logits=False,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,
    )


# ---------------------------------------------------------------- the LightningModule


def make_module(
    row: str,
    shape: Shape,
    seq: int,
    pretrained: str | None,
    lr: float,
    prefetch: bool,
    optimizer: str,
    compile_layers: bool = False,
    compile_dense_only: bool = False,
    manual_gc: bool = False,
    lora: bool = False,
) -> Any:
    from lightning.pytorch import LightningModule

    class BenchModule(LightningModule):
        """Builds the model in ``configure_model``; the loss is the model's own LM loss."""

        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from transformers import AutoModelForCausalLM

            impl = "eager" if row == "eager" else "grouped_mm"
            if row == "hf_ep":
                from transformers import DistributedConfig

                config = DistributedConfig(tp_size=world(), enable_expert_parallel=True)
                self.model = AutoModelForCausalLM.from_pretrained(
                    pretrained, distributed_config=config, dtype=torch.bfloat16, experts_implementation=impl
                )
                return
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(
                    hf_config(shape, seq), experts_implementation=impl, attn_implementation="sdpa"
                )
            if lora:
                from peft import get_peft_model

                model = get_peft_model(model, lora_config())
            if row in ("eager", "grouped_mm"):
                shard_baseline(model, self.device_mesh["data_parallel"], self.device)
                if compile_layers:
                    from lightning_ep.parallel import compile as compiling

                    compiling.compile_blocks(decoder_layers(model))
                    compiling.compile_loss(model)  # as Execution(compile=True) does
                    compiling.compile_head(model)
            self.model = model

        def on_fit_start(self) -> None:
            if prefetch:
                set_prefetch(self.model)
            if compile_dense_only:
                from lightning_ep.parallel.compile import compile_blocks
                from lightning_ep.parallel.fsdp import decoder_blocks

                compile_blocks(decoder_blocks(self.model), routing=False)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if manual_gc:  # Python's collector off, a young-generation pass every 5 steps instead
                if batch_idx == 0:
                    gc.collect()
                    gc.disable()
                elif batch_idx % 5 == 0:
                    gc.collect(1)
            return self.model(input_ids=batch, labels=batch, use_cache=False).loss

        def on_fit_end(self) -> None:
            if manual_gc:
                gc.enable()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if row == "hf_ep":  # HF 5.17's EP mixes plain tensors and DTensors: foreach / fused fail there
                return torch.optim.AdamW(self.parameters(), lr=lr, foreach=False)
            if optimizer == "lightning_ep":
                from lightning_ep.optim import AdamW

                return AdamW(self.parameters(), lr=lr)
            if optimizer == "fused":
                return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)
            return torch.optim.AdamW(self.parameters(), lr=lr, foreach=True)

    return BenchModule()


def lora_config() -> Any:
    """The ``+lora`` rows' adapters: rank 16 on the attention projections and both expert weights."""
    from peft import LoraConfig

    return LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a Hugging Face causal LM, wrapped by PEFT or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def shard_baseline(model: Any, mesh: Any, device: torch.device) -> None:
    """FSDP2 as a Lightning user writes it: each decoder layer, then the root; then materialise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_ep.models.init import materialize

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    materialize(model, device)


def set_prefetch(model: Any) -> None:
    """Explicit FSDP2 prefetch: each decoder layer gathers the next one's parameters in forward
    and the previous one's in backward, whatever the host does in between (a host sync in a MoE
    layer otherwise delays the next all-gather until the sync returns)."""
    from torch.distributed.fsdp import FSDPModule

    layers = [m for m in decoder_layers(model) if isinstance(m, FSDPModule)]
    for current, following in itertools.pairwise(layers):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


# ---------------------------------------------------------------- one row


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (count, seq), generator=g)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


KERNEL_CLASSES = (
    ("all-to-all / collectives", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("GEMM", ("gemm", "cutlass", "sm90_", "nvjet", "cublas", "grouped")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("permutation (index/sort/scatter)", ("index", "scatter", "gather", "sort", "radix", "cub::", "searchsorted")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in lowered for k in keys):
            return label
    return "elementwise / other"


def summarize_profile(prof: Any, wall_ms: float) -> dict[str, float]:
    """GPU kernel milliseconds of one profiled step by class, and the step's wall time."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:  # CPU ops would count their kernels twice
            continue
        if getattr(event, "is_user_annotation", False):  # a host range's GPU span (with CPU activity on)
            continue
        us = float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        if us <= 0:
            continue
        label = kernel_class(event.key)
        totals[label] = totals.get(label, 0.0) + us / 1e3
        kernels.append((us / 1e3, event.key))
    totals["sum of kernels"] = sum(totals.values())
    totals["step wall"] = wall_ms
    log("top kernels of the profiled step (ms, class, name):")
    for ms, name in sorted(kernels, reverse=True)[:25]:
        log(f"  {ms:8.2f}  {kernel_class(name):34s} {name[:150]}")
    return totals


def _callback(warmup: int, steps: int, device: torch.device, profile: bool, trace: str | None = None) -> Any:
    from lightning.pytorch import Callback

    class StepClock(Callback):
        """Host clock around the timed steps (synchronised at both ends), peak memory between."""

        def __init__(self) -> None:
            self.seconds = float("nan")
            self.first_step = float("nan")  # the first training step, compilation and capture included
            self.peak = 0
            self._t0 = 0.0
            self._first0 = 0.0
            self.profile: dict[str, float] = {}
            self._prof: Any = None

        def _sync(self) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self._sync()
                self._first0 = time.perf_counter()
            if batch_idx == warmup:
                self._sync()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                self._t0 = time.perf_counter()
            if profile and batch_idx == warmup + steps and rank() == 0:
                from torch.profiler import ProfilerActivity, schedule

                activities = [ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]
                if trace and ProfilerActivity.CPU not in activities:
                    activities.append(ProfilerActivity.CPU)  # host ops too, to explain idle GPU time
                # One warm-up step under the profiler (its first-use costs in each thread stay out
                # of the record), then the recorded step.
                sched = schedule(wait=0, warmup=1, active=1, repeat=1)
                self._prof = torch.profiler.profile(activities=activities, schedule=sched)
                self._prof.__enter__()
            if self._prof is not None and batch_idx == warmup + steps + 1:
                self._sync()
                self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self._sync()
                self.first_step = time.perf_counter() - self._first0
            if batch_idx == warmup + steps - 1:
                self._sync()
                self.seconds = time.perf_counter() - self._t0
                if device.type == "cuda":
                    self.peak = torch.cuda.max_memory_allocated(device)
            if self._prof is not None and batch_idx == warmup + steps:
                self._sync()  # the warm-up step's kernels stay out of the record
                self._prof.step()  # the recorded step follows
            if self._prof is not None and batch_idx == warmup + steps + 1:
                self._sync()
                wall_ms = (time.perf_counter() - self._t0) * 1e3
                self._prof.step()  # ends the record
                self._prof.__exit__(None, None, None)
                if trace:
                    Path(trace).parent.mkdir(parents=True, exist_ok=True)
                    self._prof.export_chrome_trace(trace)
                self.profile = summarize_profile(self._prof, wall_ms)
                self._prof = None

    return StepClock()


def row_budget(args: Any, shape: Shape) -> int:
    """``--row-budget`` times the rows a rank's experts receive on average, rounded up to 128."""
    rows = args.row_budget * args.batch * args.seq * shape.top_k
    return -(-int(rows) // 128) * 128


def execution_of(base: str, options: list[str], args: Any, shape: Shape) -> Any:
    """The row's ``lightning_ep.Execution``: automatic (the defaults a user gets) unless an option forces
    a choice; ``+eager`` forces every choice off (no compile, graphs or single-rank FSDP2). ``fused_adamw``
    is left to report the row's optimizer: forcing it off would refuse ``lightning_ep.optim.AdamW``."""
    from lightning_ep import Execution

    forced: dict[str, Any] = {}
    if "eager" in options:
        forced |= {"compile": False, "cuda_graphs": False, "single_rank_fsdp": False}
    if "zero3" in options:
        forced["single_rank_fsdp"] = False
    if "compile" in options:
        forced["compile"] = True
    if "graph" in options:
        forced["cuda_graphs"] = True
    if "nograph" in options:
        forced["cuda_graphs"] = False
    if "dedup" in options:
        forced["token_dedup"] = True
    if base == "ep:symm":
        forced["exchange"] = "symmetric_memory"
    if "budget" in options:
        forced["row_budget"] = row_budget(args, shape)
    if "autobudget" in options:
        forced["row_budget"] = "auto"
    return Execution(**forced)


def run_row(row: str, shape: Shape, args: Any, device: torch.device, pretrained: str | None) -> dict:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.strategies import ModelParallelStrategy

    row, _, code = row.partition("@")
    base, *options = row.split("+")
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if held:
        log(f"memory held before the row: {held / 2**30:.2f} GiB (subtracted from its peak)")
    seed_everything(0, workers=True)
    batch = args.batch * world() if base == "hf_ep" else args.batch
    if base.startswith("ep:"):
        from lightning_ep import ExpertParallelStrategy, MoEConfig

        balancing = next((o for o in options if o in ("none", "aux_loss", "sinkhorn", "balanced")), args.balancing)
        moe = MoEConfig(
            moe_load_balancing=balancing,  # type: ignore[arg-type]
            moe_all_to_all_dispatcher=base in ("ep:a2a", "ep:symm"),
        )
        checkpointing: bool | str = "keep_all_to_all" if "ac_keep" in options else "ac" in options
        strategy: Any = ExpertParallelStrategy(
            degree=world(),
            moe=moe,
            reshard_after_forward=False if "zero2" in options else None,
            execution=execution_of(base, options, args, shape),
            activation_checkpointing=checkpointing,  # type: ignore[arg-type]
            frozen_experts=next((o for o in options if o in ("fp8", "mxfp4", "nf4")), None),  # type: ignore[arg-type]
            expert_gemms="fp8" if "fp8gemm" in options else None,
        )
    elif base == "hf_ep":
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world())
    else:
        strategy = ModelParallelStrategy(data_parallel_size=world(), tensor_parallel_size=1)
    trace = None
    if args.trace:
        trace = str(Path(args.trace) / f"{shape.name}_{row.replace(':', '_').replace('+', '_').replace('@', '_')}.json")
    clock = _callback(args.warmup, args.steps, device, args.profile, trace)
    callbacks: list[Any] = [clock]
    if "monitor" in options:
        # Worst case for the monitor's cost: its window (one all-reduce + one host read) every step.
        from lightning_ep import MoEMonitor

        callbacks.append(MoEMonitor(every_n_steps=1, plots=False))
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=world(),
        strategy=strategy,
        precision=args.precision,
        max_steps=args.warmup + args.steps + (2 if args.profile else 0),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = make_module(
        base,
        shape,
        args.seq,
        pretrained,
        args.lr,
        prefetch="prefetch" in options,
        manual_gc="manualgc" in options,
        optimizer="lightning_ep" if "adamw" in options else args.optimizer,
        compile_layers="compile" in options,
        compile_dense_only="compile_dense" in options,
        lora="lora" in options,
    )
    steps = args.warmup + args.steps + 2
    data = torch.utils.data.DataLoader(_Tokens(steps * batch * world(), args.seq, shape.vocab), batch_size=batch)
    with variant(code or "fast"):
        trainer.fit(module, data)

    stats = torch.tensor(
        [clock.seconds, float(clock.peak - held), clock.first_step], dtype=torch.float64, device=device
    )
    if dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    seconds, peak, first_step = stats.tolist()
    tokens_per_gpu = batch * args.seq * args.steps / (world() if base == "hf_ep" else 1)
    del trainer, module, data
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "tokens_per_gpu": tokens_per_gpu,
        "peak": peak,
        "first step s": first_step,
        "profile": clock.profile,
    }


def save_pretrained_once(shape: Shape, seq: int, device: torch.device, folder: str) -> None:
    """Write a random bf16 checkpoint for the ``hf_ep`` row (its loader reads a folder)."""
    from transformers import AutoModelForCausalLM

    if rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(shape, seq), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.barrier()


ROW_LABELS = {
    "eager": "(a) HF eager experts + FSDP2",
    "grouped_mm": "(b) HF grouped_mm experts + FSDP2",
    "hf_ep": "(c) HF built-in EP",
    "ep:a2a": "(d) lightning_ep all-to-all",
    "ep:allgather": "(d) lightning_ep all-gather",
    "ep:symm": "(d) lightning_ep symmetric-memory pulls",
}


#: Every ``+option`` a row may carry (module docstring); the balancing modes set the row's ``MoEConfig``.
ROW_OPTIONS = frozenset(
    {"eager", "compile", "compile_dense", "graph", "nograph", "dedup", "budget", "autobudget", "adamw", "prefetch"}
    | {"ac", "ac_keep", "zero2", "zero3", "monitor", "manualgc", "lora", "none", "aux_loss", "sinkhorn", "balanced"}
    | {"fp8", "mxfp4", "nf4", "fp8gemm"}
)


def row_problem(row: str) -> str | None:
    """What is wrong with a ``--rows`` entry, in words, or ``None``: an unknown base, option or
    variant, or options that contradict each other (a typo would otherwise run the defaults unseen)."""
    spec, _, code = row.partition("@")
    base, *options = spec.split("+")
    if base not in ROW_LABELS:
        return f"row {row!r}: {base!r} is not one of {sorted(ROW_LABELS)}"
    unknown = sorted(set(options) - ROW_OPTIONS)
    if unknown:
        return f"row {row!r}: unknown option(s) {unknown}; the options are {sorted(ROW_OPTIONS)}"
    if code and code not in VARIANTS:
        return f"row {row!r}: unknown variant {code!r}; the variants are {list(VARIANTS)}"
    if {"graph", "nograph"} <= set(options):
        return f"row {row!r}: +graph and +nograph contradict each other; pass one"
    frozen = [o for o in options if o in ("fp8", "mxfp4", "nf4")]
    if frozen and (not base.startswith("ep:") or "lora" not in options or len(frozen) > 1):
        return f"row {row!r}: +{frozen[0]} keeps frozen experts quantized: pass one format, on an ep: row with +lora"
    if "fp8gemm" in options and (not base.startswith("ep:") or "lora" in options):
        return f"row {row!r}: +fp8gemm runs trainable experts' GEMMs in FP8: an ep: row without +lora"
    modes = [o for o in options if o in ("none", "aux_loss", "sinkhorn", "balanced")]
    if len(modes) > 1:
        return f"row {row!r}: balancing modes {modes} contradict each other; pass one"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Shapes with a shared expert are bench_layer's: a MixtralConfig has none.
    parser.add_argument("--shape", default="coarse", choices=sorted(k for k, v in SHAPES.items() if not v.shared_inter))
    parser.add_argument("--rows", nargs="+", default=["grouped_mm", "ep:a2a"])
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="bf16-true", choices=["bf16-true", "bf16-mixed", "32-true"])
    parser.add_argument("--balancing", default="none", choices=["none", "aux_loss", "sinkhorn", "balanced"])
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--row-budget",
        type=float,
        default=1.25,
        help="+budget rows: Execution(row_budget=...) over the rows a rank's experts receive on average "
        "(batch x seq x top_k), rounded up to 128",
    )
    parser.add_argument(
        "--optimizer",
        default="fused",
        choices=["fused", "foreach", "lightning_ep"],
        help="AdamW: torch's fused or foreach kernels, or lightning_ep.optim.AdamW (hf_ep: foreach=False)",
    )
    parser.add_argument("--pretrained-dir", default="/tmp/bench_step_hf_ep")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile two extra steps (a warm-up under the profiler, then the recorded one): kernel time by class",
    )
    parser.add_argument(
        "--trace", default=None, help="with --profile: also record host ops and write a Chrome trace per row here"
    )
    add_record_args(parser)
    args = parser.parse_args()
    for row in args.rows:
        problem = row_problem(row)
        if problem:
            parser.error(problem)

    import dataclasses

    shape = SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    cuda = torch.cuda.is_available()
    if world() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dense = dense_gemm_tflops(device)
    flops_per_token = model_flops_per_token(shape, args.seq)
    log(f"dense GEMM {dense:.0f} TFLOP/s; model {flops_per_token / 1e9:.2f} GFLOP per token")

    pretrained = None
    if any(r.startswith("hf_ep") for r in args.rows):
        pretrained = f"{args.pretrained_dir}_{shape.name}_{shape.layers}"
        save_pretrained_once(shape, args.seq, device, pretrained)

    table = []
    profiles = []
    for row in args.rows:
        spec, _, code = row.partition("@")
        base, _, option = spec.partition("+")
        option = option.replace("+", " + ")
        label = ROW_LABELS.get(base, base) + (f" + {option}" if option else "") + (f" [{code} code]" if code else "")
        if base.startswith("ep:"):
            if world() == 1:
                label = "(d) lightning_ep (local dispatch)" + (f" + {option}" if option else "")
                label += f" [{code} code]" if code else ""
            label += f", degree {world()}"
        log(f"--- {label}")
        try:
            result = run_row(row, shape, args, device, pretrained)
        except Exception as error:  # one failing baseline must not hide the others
            if rank() == 0:
                traceback.print_exc()
            table.append({"row": label, "GPUs": world(), "status": f"failed: {type(error).__name__}: {error}"[:200]})
            result = None
        # The row's trainer, strategy and model hold one another: collect them here, where neither
        # run_row's locals nor a failure's traceback remain, so the next row starts on free memory.
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if result is None:
            continue
        tok_s = result["tokens_per_gpu"] / result["seconds"]
        tflops = tok_s * flops_per_token / 1e12
        entry = {
            "row": label,
            "GPUs": world(),
            "tok/s/GPU": tok_s,
            "TFLOP/s/GPU": tflops,
            "MFU %": 100 * tflops / dense,
            "step s": result["seconds"] / args.steps,
            "first step s": result["first step s"],
            "peak GiB": result["peak"] / 2**30,
            "status": "ok",
        }
        log(entry)
        table.append(entry)
        if result["profile"]:
            profiles.append({"row": label, **{k: round(v, 2) for k, v in result["profile"].items()}})

    text = markdown_table(table)
    if profiles:
        text += "\nOne profiled step (rank 0), GPU kernel milliseconds by class:\n\n" + markdown_table(profiles)
    notes = (
        f"Shape {args.shape} ({shape}), seq {args.seq}, {args.batch} sequences per GPU per step, "
        f"precision {args.precision}, balancing {args.balancing!r}, AdamW ({args.optimizer}; hf_ep: foreach=False) "
        f"lr {args.lr}; "
        f"{args.steps} timed steps after {args.warmup} warm-ups. Dense bf16 GEMM in this process: "
        f"{dense:.0f} TFLOP/s. Model FLOPs per token: {flops_per_token / 1e9:.2f} G "
        "(6 x active parameters + causal attention, see `_common.model_flops_per_token`)."
    )
    report(f"bench_step: {args.shape}, {world()} GPU(s)", text, notes, args.record, args.results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
