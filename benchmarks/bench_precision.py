"""Which precision recipe learns at a fine-tuning learning rate: the same model, data and schedule
trained through the Lightning Trainer under each recipe, loss curves side by side.

Rows (``--rows``, run one after another in this process, each with its own Trainer; repeat them in
mirrored order, ``--rows a b c c b a``, to see the run-to-run spread):

- ``bf16-true``: bf16 parameters, ``torch.optim.AdamW(fused=True)``. An update smaller than half a
  bf16 step of its weight (``2^-9`` of it) rounds away: at ``lr=1e-5`` most weights, the norms'
  ones included, do not move.
- ``bf16-true+sr``: bf16 parameters, ``torchao.optim._AdamW(bf16_stochastic_round=True)``: the
  update in fp32, rounded to bf16 up or down at random in proportion to the distance, so small
  updates land on average. Needs torchao (refused up front without it).
- ``bf16-mixed``: fp32 master weights under Lightning's bf16 autocast, ``torch.optim.AdamW(fused=True)``:
  the reference, whose final loss the other rows' gaps are taken to.
- ``bf16-true+adamw``: bf16 parameters, ``lightning_ep.optim.AdamW`` (torch's fused AdamW bit for
  bit, one kernel per large tensor): learns as ``bf16-true`` does, at its own speed.
- ``32-true``: fp32 throughout, ``torch.optim.AdamW(fused=True)``: the arithmetic the others round.
- ``bf16-mixed+fp8gemm``: ``bf16-mixed`` with the experts' GEMMs in FP8
  (``ExpertParallelStrategy(expert_gemms="fp8")``; a GPU of compute capability 9.0+ and torchao).
- ``bf16-true+sr+frozen-norms``, ``32-true+frozen-norms``: those recipes with every normalisation
  weight frozen at its initial value (``requires_grad=False``): what ``bf16-mixed``'s forward sees
  of them when no update reaches half a bf16 step of a weight of 1.0 (the control for why
  ``bf16-mixed`` ends above fp32).
- ``bf16-mixed+dither``: ``bf16-mixed`` with ``ExpertParallelStrategy(dither_master_weights=True)``:
  each fp32 master weight loaded from bf16 moved, at setup, to a hashed point of the interval that
  rounds to its bf16 value, so the forward's bf16 weights keep their bits at the start and a weight's
  drift then changes them with a probability in proportion to its size, instead of only past half a
  bf16 step.

Every row starts from one random initialisation (a bf16 checkpoint written once with ``--seed``,
read by ``lightning_ep.models.pretrained.from_pretrained``: the same values in bf16 and fp32
parameters), sees one token stream in one order, and follows one schedule: ``--lr`` after
``--warmup`` linear warm-up steps, cosine to zero at ``--steps``. Only the optimizer's learning
rate is set per step; torchao keeps it as a Tensor, which torch's schedulers fill in place, and
every row's applied rates are recorded and checked against the schedule.

The stream (``markov_tokens``): a seeded Markov chain over the vocabulary, each token followed by
one of ``SUCCESSORS`` others with halving probabilities, the successors drawn with Zipf weights, so
that a model learns first the frequent tokens, then the transitions; the loss of a model that knows
the chain (its conditional entropy, "floor") is reported beside the curves.

The model is ``ExpertParallelStrategy(degree=--degree)`` with the defaults a user gets (automatic
``Execution``; ``moe_load_balancing`` the default unless ``--balancing``), ``batch x seq`` tokens per
GPU per step (8,192 by default, as ``bench_step.py``). Per run: the loss at every step (on several
GPUs the mean over ranks), the final loss (mean of the last 10 steps), tokens/s per GPU over steps
``--time-from`` to the end (a synchronised host clock, as ``bench_step.py``: compilation stays out),
peak memory allocated over those steps, and the final loss's relative gap to the ``bf16-mixed``
runs' mean. Printed as a table; the curves and learning rates go to ``--out`` as JSON.

    python benchmarks/bench_precision.py --shape fine --out /tmp/precision_fine.json \\
        --rows bf16-true bf16-true+sr bf16-mixed bf16-mixed bf16-true+sr bf16-true
    python benchmarks/bench_precision.py --shape tiny --steps 3 --seq 64 --time-from 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    SHAPES,
    Shape,
    add_record_args,
    command_line,
    device_name,
    log,
    markdown_table,
    rank,
    report,
    versions,
    world,
)

# Shape letters: N sequences, S positions in a sequence, V vocabulary, K successors of a token.

SUCCESSORS = 8  # K: tokens that may follow a token
ZIPF = 1.1  # exponent of the successors' frequency over the vocabulary
FINAL_STEPS = 10  # the final loss is the mean over this many last steps


@dataclass(frozen=True)
class Recipe:
    """One row: the Trainer's precision and the optimizer that steps the parameters."""

    precision: str
    optimizer: str  # "torch": AdamW(fused=True); "torchao-sr": torchao _AdamW, stochastic rounding; "lightning_ep"
    label: str
    expert_gemms: str | None = None  # ExpertParallelStrategy(expert_gemms=...)
    frozen_norms: bool = False  # the normalisation weights keep their initial values
    dither: bool = False  # ExpertParallelStrategy(dither_master_weights=True)


ROWS = {
    "bf16-true": Recipe("bf16-true", "torch", "bf16-true, torch AdamW(fused=True)"),
    "bf16-true+sr": Recipe("bf16-true", "torchao-sr", "bf16-true, torchao _AdamW(bf16_stochastic_round=True)"),
    "bf16-mixed": Recipe("bf16-mixed", "torch", "bf16-mixed (fp32 master weights), torch AdamW(fused=True)"),
    "bf16-true+adamw": Recipe("bf16-true", "lightning_ep", "bf16-true, lightning_ep.optim.AdamW"),
    "32-true": Recipe("32-true", "torch", "32-true (fp32 throughout), torch AdamW(fused=True)"),
    "bf16-mixed+fp8gemm": Recipe(
        "bf16-mixed", "torch", "bf16-mixed, the experts' GEMMs in FP8 (expert_gemms='fp8')", expert_gemms="fp8"
    ),
    "bf16-true+sr+frozen-norms": Recipe(
        "bf16-true", "torchao-sr", "bf16-true, torchao stochastic rounding, norm weights frozen", frozen_norms=True
    ),
    "bf16-mixed+dither": Recipe("bf16-mixed", "torch", "bf16-mixed, dither_master_weights=True", dither=True),
    "32-true+frozen-norms": Recipe(
        "32-true", "torch", "32-true, torch AdamW(fused=True), norm weights frozen", frozen_norms=True
    ),
}
REFERENCE = "bf16-mixed"
PARAM_DTYPES = {"bf16-true": torch.bfloat16, "bf16-mixed": torch.float32, "32-true": torch.float32}


# ---------------------------------------------------------------- the data


def markov_tokens(count: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, float]:
    """``count`` sequences of ``seq`` tokens from a seeded Markov chain over ``vocab`` tokens, and
    the chain's conditional entropy over them (nats per predicted token: the loss floor).

    Each token has ``SUCCESSORS`` successors, drawn with Zipf weights over a shuffled vocabulary
    (repeats allowed) and taken with probabilities ``1/2, 1/4, ...`` (renormalised); each sequence
    starts at a Zipf-drawn token. Returns ``(tokens_NS int64, floor)``.
    """
    g = torch.Generator().manual_seed(seed)
    zipf_V = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-ZIPF)[torch.randperm(vocab, generator=g)]
    successors_VK = torch.multinomial(zipf_V, vocab * SUCCESSORS, replacement=True, generator=g).view(vocab, SUCCESSORS)
    choice_K = torch.full((SUCCESSORS,), 0.5, dtype=torch.float64).cumprod(0)
    choice_K /= choice_K.sum()

    tokens_NS = torch.empty(count, seq, dtype=torch.int64)
    tokens_NS[:, 0] = torch.multinomial(zipf_V, count, replacement=True, generator=g)
    picks_NS = torch.multinomial(choice_K, count * seq, replacement=True, generator=g).view(count, seq)
    for s in range(1, seq):
        tokens_NS[:, s] = successors_VK[tokens_NS[:, s - 1], picks_NS[:, s]]

    # P(next | token) merges repeated successors; entropy per token, averaged over the predictions.
    keys = (torch.arange(vocab).unsqueeze(1) * vocab + successors_VK).flatten()
    unique, inverse = torch.unique(keys, return_inverse=True)
    p = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, choice_K.repeat(vocab))
    entropy_V = torch.zeros(vocab, dtype=torch.float64).index_add_(0, unique // vocab, -p * p.log())
    return tokens_NS, float(entropy_V[tokens_NS[:, :-1]].mean())


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, tokens_NS: torch.Tensor) -> None:
        self.tokens_NS = tokens_NS

    def __len__(self) -> int:
        return self.tokens_NS.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens_NS[i]


# ---------------------------------------------------------------- schedule, model, optimizer


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The schedule's multiple of the peak rate at ``step`` (0-based): ``(step + 1) / warmup`` over
    the warm-up, then a cosine from 1 to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup: int, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """``lr_factor`` as a torch scheduler, stepped once per optimizer step. torch's schedulers assign
    a float ``lr`` and fill a Tensor one in place (torchao's optimizers hold a Tensor and refuse a
    float), starting from a copy of it (``initial_lr``), so one scheduler serves every row."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, steps))


def make_optimizer(recipe: Recipe, params: Any, lr: float) -> torch.optim.Optimizer:
    """The row's AdamW at its defaults otherwise (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01)."""
    if recipe.optimizer == "torchao-sr":
        from torchao.optim import _AdamW

        return _AdamW(params, lr=lr, bf16_stochastic_round=True)  # keeps lr as a Tensor
    if recipe.optimizer == "lightning_ep":
        from lightning_ep.optim import AdamW

        return AdamW(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, fused=True)


def freeze_norms(model: torch.nn.Module) -> int:
    """Freeze the weights of every normalisation module (a class named ``...Norm``: Hugging Face's
    RMSNorms, ``nn.LayerNorm``); returns how many elements were frozen (an error if none)."""
    frozen = 0
    for module in model.modules():
        if type(module).__name__.endswith("Norm"):
            for param in module.parameters(recurse=False):
                param.requires_grad_(False)
                frozen += param.numel()
    if not frozen:
        raise RuntimeError(f"freeze_norms: {type(model).__name__} has no module named ...Norm")
    return frozen


def make_module(recipe: Recipe, folder: str, lr: float, warmup: int, steps: int) -> Any:
    from lightning.pytorch import LightningModule

    class PrecisionModule(LightningModule):
        """Reads the shared initial checkpoint in ``configure_model``; the loss is the model's LM loss."""

        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:  # built on the meta device; the strategy reads the checkpoint into it
                from lightning_ep.models.pretrained import from_pretrained

                # The checkpoint's config says bfloat16, which from_config would follow under bf16-mixed too:
                # the dtype is the precision's instead (fp32 master weights under bf16-mixed).
                self.model = from_pretrained(folder, dtype=PARAM_DTYPES[recipe.precision])
                if recipe.frozen_norms:
                    freeze_norms(self.model)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch, use_cache=False).loss

        def configure_optimizers(self) -> Any:
            optimizer = make_optimizer(recipe, self.parameters(), lr)
            scheduler = make_scheduler(optimizer, warmup, steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return PrecisionModule()


def save_init_once(shape: Shape, seq: int, device: torch.device, folder: str, seed: int) -> None:
    """Write the rows' common random initialisation as a bf16 Hugging Face checkpoint (rank 0, once)."""
    from bench_step import hf_config
    from transformers import AutoModelForCausalLM

    if rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(shape, seq), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- one run


def _recorder(time_from: int, steps: int, device: torch.device) -> Any:
    from lightning.pytorch import Callback

    class Recorder(Callback):
        """The loss of every step (kept on the device: no host sync), the learning rate each step
        applied, the host clock around steps ``time_from..steps-1`` (synchronised at both ends) and
        the peak memory allocated over them."""

        def __init__(self) -> None:
            self.losses: torch.Tensor | None = None
            self.lrs: list[float] = []
            self.dtypes: dict[str, int] = {}
            self.seconds = float("nan")
            self.first_step = float("nan")
            self.peak = 0
            self._t0 = 0.0

        def _sync(self) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            self.losses = torch.zeros(steps, dtype=torch.float32, device=device)
            for p in module.parameters():
                self.dtypes[str(p.dtype)] = self.dtypes.get(str(p.dtype), 0) + p.numel()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            # The scheduler steps after the optimizer: the rate read here is the one this step applies.
            self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
            if batch_idx in (0, time_from):
                self._sync()
                self._t0 = time.perf_counter()
            if batch_idx == time_from and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, batch_idx: int) -> None:
            assert self.losses is not None
            self.losses[batch_idx].copy_(out["loss"])
            if batch_idx == 0:
                self._sync()
                self.first_step = time.perf_counter() - self._t0
            if batch_idx == steps - 1:
                self._sync()
                self.seconds = time.perf_counter() - self._t0
                if device.type == "cuda":
                    self.peak = torch.cuda.max_memory_allocated(device)

    return Recorder()


def run_row(name: str, args: Any, data: torch.utils.data.Dataset, folder: str, device: torch.device) -> dict:
    """Train one row for ``args.steps`` steps from the shared checkpoint; its curves and measurements."""
    from lightning.pytorch import Trainer, seed_everything

    from lightning_ep import ExpertParallelStrategy, MoEConfig

    recipe = ROWS[name]
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    seed_everything(args.seed, workers=True)  # stochastic rounding draws from it
    moe = MoEConfig(moe_load_balancing=args.balancing) if args.balancing else None
    recorder = _recorder(args.time_from, args.steps, device)
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=world(),
        strategy=ExpertParallelStrategy(
            degree=args.degree, moe=moe, expert_gemms=recipe.expert_gemms, dither_master_weights=recipe.dither
        ),  # type: ignore[arg-type]
        precision=recipe.precision,  # type: ignore[arg-type]
        max_steps=args.steps,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = make_module(recipe, folder, args.lr, args.warmup, args.steps)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    trainer.fit(module, loader)

    assert recorder.losses is not None
    losses = recorder.losses
    stats = torch.tensor([recorder.seconds, float(recorder.peak - held)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(losses)  # each rank trained on its own sequences: the curve is their mean
        losses /= world()
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    seconds, peak = stats.tolist()
    curve = losses.tolist()
    del trainer, module, loader, losses
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if set(recorder.dtypes) != {str(PARAM_DTYPES[recipe.precision])}:
        raise RuntimeError(
            f"row {name!r}: parameters of {recorder.dtypes} (elements by dtype); {recipe.precision} trains "
            f"{PARAM_DTYPES[recipe.precision]} ones: the model was not built in the precision's dtype."
        )
    expected = [args.lr * lr_factor(s, args.warmup, args.steps) for s in range(args.steps)]
    if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(recorder.lrs, expected, strict=True)):
        raise RuntimeError(
            f"row {name!r}: the learning rates applied, {recorder.lrs[:3]}..., are not the schedule's, "
            f"{expected[:3]}...: the LR scheduler did not reach this optimizer's param_groups['lr']."
        )
    timed = args.steps - args.time_from
    return {
        "row": name,
        "recipe": recipe.label,
        "precision": recipe.precision,
        "parameter_numel_by_dtype": recorder.dtypes,
        "losses": curve,
        "lrs": recorder.lrs,
        "final_loss": sum(curve[-FINAL_STEPS:]) / len(curve[-FINAL_STEPS:]),
        "tokens_per_s_per_gpu": args.batch * args.seq * timed / seconds,
        "peak_gib": peak / 2**30,
        "first_step_s": recorder.first_step,
        "status": "ok",
    }


# ---------------------------------------------------------------- the command


def torchao_problem() -> str | None:
    """Why ``torchao.optim._AdamW`` cannot be imported here, or ``None``."""
    try:
        from torchao.optim import _AdamW  # noqa: F401
    except Exception as error:  # a broken install fails here as well as a missing one
        return f"{type(error).__name__}: {error}"
    return None


def check_args(parser: argparse.ArgumentParser, args: Any) -> None:
    """Refuse arguments that cannot run, before any work (each message names the fix)."""
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: train at least one step")
    if not 0 <= args.time_from < args.steps:
        parser.error(
            f"--time-from {args.time_from} must lie in 0..{args.steps - 1} (the timed steps run from it to "
            f"--steps {args.steps}): pass a smaller --time-from or more --steps"
        )
    if args.degree < 1 or world() % args.degree:
        parser.error(
            f"--degree {args.degree} must divide the {world()} process(es) launched: "
            f"run under torchrun --nproc-per-node {max(args.degree, 1)}, or pass --degree 1"
        )
    stochastic = [r for r in args.rows if ROWS[r].optimizer == "torchao-sr"]
    if stochastic:
        problem = torchao_problem()
        if problem:
            parser.error(
                f"--rows {stochastic[0]} needs torchao (torchao.optim._AdamW), which does not import here "
                f"({problem}): pip install torchao, or drop {' and '.join(stochastic)} from --rows"
            )


def torchao_version() -> str:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def summarize(runs: list[dict[str, Any]], args: Any, shape: Shape, floor: float) -> tuple[str, str]:
    """Adds each run's ``gap_to_bf16_mixed`` (to the mean final loss of the ``bf16-mixed`` runs);
    returns the markdown table and its notes."""
    finals = [r["final_loss"] for r in runs if r["row"] == REFERENCE and r["status"] == "ok"]
    reference = sum(finals) / len(finals) if finals else None
    table = []
    for r in runs:
        ok = r["status"] == "ok"
        if ok and reference is not None:
            r["gap_to_bf16_mixed"] = (r["final_loss"] - reference) / reference
        gap = r.get("gap_to_bf16_mixed")
        table.append(
            {
                "row": r["row"],
                "final loss": f"{r['final_loss']:.4f}" if ok else "-",
                f"gap to {REFERENCE}": f"{100 * gap:+.2f}%" if gap is not None else "-",
                "tok/s/GPU": f"{r['tokens_per_s_per_gpu']:,.0f}" if ok else "-",
                "peak GiB": f"{r['peak_gib']:.1f}" if ok else "-",
                "status": r["status"][:200],
            }
        )
    first = [r["losses"][0] for r in runs if r["status"] == "ok"]
    notes = (
        f"Shape {args.shape} ({shape}), {args.batch} x {args.seq} tokens per GPU per step, {world()} GPU(s), "
        f"degree {args.degree}, balancing {args.balancing or 'the default'}, torchao {torchao_version()}; "
        f"lr {args.lr} after {args.warmup} warm-up steps, cosine to 0 at {args.steps} steps; final loss: mean "
        f"of the last {FINAL_STEPS} steps; tokens/s over steps {args.time_from}..{args.steps - 1}. Token "
        f"stream: Markov chain, {SUCCESSORS} successors per token, floor {floor:.3f} nats"
        + (f"; loss at step 0 {min(first):.4f}..{max(first):.4f}." if first else ".")
    )
    return markdown_table(table), notes


def write_curves(out: Path, runs: list[dict[str, Any]], args: Any, shape: Shape, floor: float) -> None:
    """The runs, their loss and learning-rate curves, and how they were made, as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command_line(),
        "hardware": device_name(),
        "versions": {**versions(), "torchao": torchao_version()},
        "arguments": vars(args),
        "shape": dataclasses.asdict(shape),
        "stream": {"kind": "markov", "successors": SUCCESSORS, "zipf": ZIPF, "floor_nats": floor},
        "reference": REFERENCE,
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="fine", choices=["fine", "coarse", "tiny"])
    parser.add_argument("--rows", nargs="+", default=["bf16-true", "bf16-true+sr", REFERENCE], choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then a cosine to 0")
    parser.add_argument("--time-from", type=int, default=20, help="first timed step (compilation before it)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--degree", type=int, default=1, help="expert-parallel degree")
    parser.add_argument("--balancing", default=None, choices=["none", "aux_loss", "sinkhorn", "balanced"])
    parser.add_argument("--seed", type=int, default=0, help="model initialisation, token stream, each row's RNG")
    parser.add_argument(
        "--init-dir", default="/tmp/bench_precision_init", help="prefix of the initial checkpoint's folder (reused)"
    )
    parser.add_argument("--out", default=None, help="JSON of the curves (default bench_precision_SHAPE.json)")
    add_record_args(parser)
    args = parser.parse_args()
    check_args(parser, args)

    shape = SHAPES[args.shape]
    cuda = torch.cuda.is_available()
    if world() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    folder = f"{args.init_dir}_{shape.name}_s{args.seq}_seed{args.seed}"
    save_init_once(shape, args.seq, device, folder, args.seed)
    tokens_NS, floor = markov_tokens(args.steps * args.batch * world(), args.seq, shape.vocab, args.seed)
    data = _Sequences(tokens_NS)
    log(f"initial checkpoint {folder}; token stream floor {floor:.3f} nats, ln(vocab) {math.log(shape.vocab):.3f}")

    runs: list[dict[str, Any]] = []
    for name in args.rows:
        log(f"--- {name}: {ROWS[name].label}")
        try:
            result = run_row(name, args, data, folder, device)
        except Exception as error:  # one failing row must not hide the others
            if rank() == 0:
                traceback.print_exc()
            result = {"row": name, "recipe": ROWS[name].label, "status": f"failed: {type(error).__name__}: {error}"}
        # Collected here, where neither run_row's locals nor a failure's traceback remain.
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log({k: v for k, v in result.items() if k not in ("losses", "lrs")})
        runs.append(result)
        if rank() == 0:  # after every row, so a run cut short keeps the rows it finished
            write_curves(Path(args.out or f"bench_precision_{args.shape}.json"), runs, args, shape, floor)

    table, notes = summarize(runs, args, shape, floor)
    report(f"bench_precision: {args.shape}, {world()} GPU(s)", table, notes, args.record, args.results)
    if rank() == 0:  # again, with the gaps that summarize added
        out = Path(args.out or f"bench_precision_{args.shape}.json")
        write_curves(out, runs, args, shape, floor)
        log(f"curves written to {out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if any(r["status"] != "ok" for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
