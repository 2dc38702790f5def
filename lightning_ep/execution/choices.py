"""``Execution``: how the training step runs, never what it computes, chosen automatically.

Every option is ``"auto"`` by default: ``resolve`` picks, from what the strategy can see
(``Environment``), the fastest path that gives the same numbers, and leaves off what it cannot show
to be safe there. ``True`` / ``False`` (or a named exchange) force a choice for benchmarking and
debugging; a forced choice that cannot apply is refused before any work starts. ``resolve`` is a
pure function, so its setup table is tested for any environment on CPU.

What each choice does, and what ``"auto"`` picks:

- ``compile``: ``torch.compile`` the dense parts of each decoder layer, the routing of each MoE
  layer, the loss and the output head with its final norm (``lightning_ep.parallel.compile``);
  Inductor's kernels, float sums reordered. Auto: on CUDA with Triton.
- ``cuda_graphs``: replay each MoE layer's dispatch, experts and combine as CUDA graphs
  (``moe.graphs``), the same bits, where ``moe.layer_execution.graphs_blocker`` allows. Auto: on
  where the plan is static without a row budget (degree = world size = 1), off for large experts
  (``LARGE_EXPERT_ELEMENTS``, unless they carry LoRA adapters): their GEMMs keep the GPU busy, so
  replaying saves no host time, and outside graphs their backward runs one cuBLAS GEMM per expert
  on the forward's counts copied to the host meanwhile (``GroupedExperts``), faster than the
  grouped GEMMs and, for fp32 master weights, with fp32 weight gradients.
- ``exchange``: ``"collective"`` (the process group's all-to-all or all-gather: NCCL on GPUs, gloo
  on CPU; auto) or ``"symmetric_memory"`` (each GPU pulls its rows from the others' memory over
  NVLink; one node only; the same bits).
- ``token_dedup``: each token sent once per destination rank instead of once per expert (the same
  math; fewer bytes when a token's experts share ranks, more gradient bytes in fp32). Auto: off.
- ``row_budget`` (not ``"auto"``): the static size ``R`` of every rank's received rows (no host
  sync): the padded all-to-all (``"auto"`` sizes ``R`` from the first step's loads and grows it) or
  the symmetric-memory exchange (an int). A layer over ``R`` makes the forward run again with it on
  the dynamic plan (``strategy.budget_fallback``), counted in ``moe/budget_reruns``. ``None`` (the
  default): the dynamic plan (one host sync per layer).
- ``single_rank_fsdp``: at world size 1 the dense parameters skip FSDP2 (``parallel.single_rank``):
  the same bits (a reduction over one rank sums nothing) without its copies of every dense
  parameter and gradient; ``bf16-mixed`` holds a bf16 copy between steps. Not with gradient
  accumulation (FSDP2 sums the micro-batches in fp32), activation checkpointing (its recomputation
  would read the DTensors) or ``reshard_after_forward=True``. Modules outside the model (a value
  head) keep FSDP2.
- ``fused_adamw``: a report, not a choice (``lightning_ep.execution.adamw``): whether the optimizers
  Lightning set up step with ``lightning_ep.optim.AdamW``'s kernels; ``True`` / ``False`` assert it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from lightning_ep.execution.adamw import fused_adamw_row
from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.layer_execution import LayerExchange, LayerExecution
from lightning_ep.moe.layer_execution import graphs_blocker as graphs_blocker_of

Auto = Literal["auto"]
Exchange = Literal["auto", "collective", "symmetric_memory"]
EXCHANGES: tuple[str, ...] = get_args(Exchange)
_SWITCHES = ("compile", "cuda_graphs", "token_dedup", "single_rank_fsdp", "fused_adamw")
#: Elements of one routed expert's gate/up weight (``2I x H``) from which the experts count as large:
#: Mixtral-8x7B's 117 M are, DeepSeek-V3's 29 M and the finer families' are not.
LARGE_EXPERT_ELEMENTS = 2**25
#: The setup table's words for the strategy's ``frozen_experts`` formats.
FROZEN_FORMATS = {
    "fp8": "FP8 e4m3 with block scales (128 x 128, or the folder's); dequantized per layer, forward and backward",
    "mxfp4": "MXFP4: E2M1 values, an E8M0 scale per 32; dequantized per layer, forward and backward",
    "nf4": "NF4: 4-bit NormalFloat values, an fp32 absmax per 64; dequantized per layer, forward and backward",
}

#: The setup table's words for the strategy's ``expert_gemms``.
EXPERT_GEMMS = {
    "fp8": "e4m3 with dynamic row-wise scales (torchao), fp32 accumulation, bf16 outputs; all six GEMMs per layer",
}


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How the step runs (see the module docstring); ``"auto"`` everywhere by default."""

    compile: bool | Auto = "auto"
    cuda_graphs: bool | Auto = "auto"
    exchange: Exchange = "auto"
    token_dedup: bool | Auto = "auto"
    row_budget: int | Auto | None = None
    single_rank_fsdp: bool | Auto = "auto"
    fused_adamw: bool | Auto = "auto"

    def __post_init__(self) -> None:
        for name in _SWITCHES:
            value = getattr(self, name)
            if value != "auto" and not isinstance(value, bool):
                raise TypeError(f"Execution({name}={value!r}): pass 'auto', True or False.")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"Execution(exchange={self.exchange!r}) is not one of {list(EXCHANGES)}.")
        budget = self.row_budget
        number = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
        if budget is not None and budget != "auto" and not number:
            raise ValueError(
                f"Execution(row_budget={budget!r}): pass an int >= 1 (received rows per rank), 'auto' (sized from "
                "the first step, grown when routing exceeds it) or None (the dynamic plan)."
            )
        if budget == "auto" and self.exchange == "symmetric_memory":
            raise ValueError(
                "Execution(row_budget='auto') sizes the padded all-to-all; the symmetric-memory exchange takes an int "
                "budget (about 1.25-1.6 x tokens per rank x top_k): pass one, or exchange='collective'."
            )
        if budget is not None and self.token_dedup is True:
            raise ValueError(
                f"Execution(row_budget={budget!r}) pads the exchange of every (token, expert) pair, which "
                "token_dedup=True replaces; pass one of them."
            )


@dataclass(frozen=True, kw_only=True)
class Environment:
    """What the strategy sees at setup; ``resolve``'s only input besides the options."""

    device_type: str  # "cuda" or "cpu"
    triton: bool
    num_nodes: int
    devices_per_node: int
    degree: int
    replicate_degree: int = 1
    precision: str = "32-true"
    activation_checkpointing: bool | str = False
    lora_ranks: tuple[int, ...] = ()  # ranks of the LoRA adapters on the experts (PEFT's target_parameters)
    accumulate_grad_batches: int = 1
    reshard_after_forward: bool | None = None  # the strategy's argument; None: not given
    expert_elements: int = 0  # one routed expert's gate/up weight (2I x H), the largest; 0: unknown
    frozen_experts: str | None = None  # the strategy's frozen_experts: the format frozen expert weights are kept in
    expert_gemms: str | None = None  # the strategy's expert_gemms: "fp8", or None for the compute dtype's GEMMs
    optimizers: tuple[str, ...] | None = None  # by class (execution.environment.optimizer_names); None: not set up

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def describe(self) -> str:
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
        device, plural = ("GPU", "s") if self.device_type == "cuda" else ("process", "es")
        count = f"{self.devices_per_node} {device}{plural if self.devices_per_node > 1 else ''}"
        return f"{self.device_type}, {nodes} x {count}, degree {self.degree}, {self.precision}"


@dataclass(frozen=True)
class Choice:
    """One row of the setup table: the option, what is in force and why."""

    name: str
    value: str
    reason: str


@dataclass(frozen=True)
class Resolved:
    """The choices in force, and the environment they were made for."""

    compile: bool
    layers: LayerExecution  # what the MoE layers are built with (``transform``, ``make_dispatcher``)
    fused_adamw: bool  # lightning_ep.optim.AdamW's kernels step an optimizer (False before the optimizers exist)
    environment: Environment
    choices: tuple[Choice, ...] = field(default=())
    single_rank_fsdp: bool = False

    @property
    def cuda_graphs(self) -> bool:
        return self.layers.cuda_graphs

    @property
    def symmetric_memory(self) -> bool:
        return self.layers.exchange == "symmetric_memory"

    @property
    def token_dedup(self) -> bool:
        return self.layers.token_dedup

    @property
    def row_budget(self) -> int | str | None:
        return self.layers.row_budget

    def table(self) -> str:
        """The setup table printed once on rank 0: one line per choice."""
        width = max(len(c.name) for c in self.choices)
        value_width = max(len(c.value) for c in self.choices)
        lines = [f"lightning_ep execution ({self.environment.describe()}):"]
        lines += [f"  {c.name:<{width}}  {c.value:<{value_width}}  {c.reason}" for c in self.choices]
        return "\n".join(lines)


def resolve(execution: Execution, env: Environment, moe: MoEConfig) -> Resolved:
    """The choices in force for ``execution`` in ``env`` with ``moe``, and the table that says why; a
    ``ValueError`` for a forced choice that cannot apply here, naming the option, its value and the fix."""
    cuda = env.device_type == "cuda"
    fast = cuda and env.triton
    no_kernels = "CPU" if not cuda else "no Triton"
    dropless_a2a = moe.capacity_factor is None and moe.moe_all_to_all_dispatcher
    rows: list[Choice] = []

    # compile
    if execution.compile == "auto":
        compile_on = fast
        reason = "auto: CUDA with Triton" if fast else f"auto: off on {no_kernels} (compiling costs more than it saves)"
    else:
        compile_on = execution.compile
        reason = "forced"
    rows.append(Choice("compile", _on(compile_on), reason))

    # exchange
    symmetric = execution.exchange == "symmetric_memory"
    if env.degree == 1:
        if symmetric:
            raise ValueError(
                "Execution(exchange='symmetric_memory') exchanges tokens between expert-parallel ranks, but the "
                "degree is 1 (every rank holds all experts); use exchange='auto', or a degree above 1."
            )
        rows.append(Choice("exchange", "local", "degree 1: every rank holds all experts"))
    elif symmetric:
        _check_symmetric(env, moe)
        rows.append(Choice("exchange", "symmetric_memory", "forced"))
    else:
        what = "all-gather" if not moe.moe_all_to_all_dispatcher else "all-to-all"
        if not dropless_a2a:
            reason = f"MoEConfig's {what}" + (", with a capacity" if moe.capacity_factor is not None else "")
        else:
            reason = "forced" if execution.exchange == "collective" else "auto (symmetric_memory: force it)"
        rows.append(Choice("exchange", f"{what} ({'nccl' if cuda else 'gloo'})", reason))

    # row budget
    budget = execution.row_budget
    if budget is not None and (env.degree == 1 or not dropless_a2a):
        raise ValueError(
            f"Execution(row_budget={budget!r}) sizes the static plan of the dropless all-to-all between "
            f"expert-parallel ranks, but degree={env.degree}, capacity_factor={moe.capacity_factor}, "
            f"moe_all_to_all_dispatcher={moe.moe_all_to_all_dispatcher} (degree 1 and a capacity are static "
            "already); use row_budget=None."
        )
    if env.activation_checkpointing == "keep_all_to_all" and symmetric:
        raise ValueError(
            "ExpertParallelStrategy(activation_checkpointing='keep_all_to_all') keeps the collective all-to-all's "
            "exchanges, but Execution(exchange='symmetric_memory'); use exchange='auto', or "
            "activation_checkpointing=True."
        )
    if budget is not None and env.activation_checkpointing:
        raise ValueError(
            f"Execution(row_budget={budget!r}) reruns a forward over budget before its backward, but activation "
            f"checkpointing ({env.activation_checkpointing!r}) recomputes the layers inside the backward; use "
            "row_budget=None with activation checkpointing."
        )
    if env.degree > 1 and dropless_a2a:
        if budget is None:
            value, reason = "dynamic", "one host sync per layer (a static plan: row_budget='auto' or an int)"
        else:
            sized = "sized by the first step, grown to fit" if budget == "auto" else "forced"
            value, reason = str(budget), f"{sized}; no host sync; a forward over it reruns on the dynamic plan"
        rows.append(Choice("row_budget", value, reason))

    # token dedup
    dedup = execution.token_dedup is True
    if dedup:
        if env.degree == 1 or not dropless_a2a or symmetric:
            raise ValueError(
                f"Execution(token_dedup=True) deduplicates the dropless NCCL all-to-all, but degree={env.degree}, "
                f"capacity_factor={moe.capacity_factor}, moe_all_to_all_dispatcher={moe.moe_all_to_all_dispatcher}, "
                f"exchange={'symmetric_memory' if symmetric else 'collective'}; use token_dedup='auto'."
            )
        rows.append(Choice("token_dedup", "on", "forced"))
    elif env.degree > 1 and dropless_a2a and not symmetric:
        reason = "forced" if execution.token_dedup is False else "auto: faster only at large batches"
        rows.append(Choice("token_dedup", "off", reason))

    # CUDA graphs
    graphs_blocker = graphs_blocker_of(
        moe,
        env.degree,
        static_plan=symmetric and budget is not None,
        world_size=env.world_size,
        cuda_triton=fast,
        precision=env.precision,
        activation_checkpointing=env.activation_checkpointing,
        lora_ranks=env.lora_ranks,
        frozen_experts=env.frozen_experts,
    )
    if isinstance(execution.cuda_graphs, bool):
        if execution.cuda_graphs and graphs_blocker is not None:
            raise ValueError(f"Execution(cuda_graphs=True) needs {graphs_blocker}; use cuda_graphs='auto'.")
        graphs = execution.cuda_graphs
        rows.append(Choice("cuda_graphs", _on(graphs), "forced"))
    else:
        if graphs_blocker is None and symmetric:
            graphs_blocker = "a forced choice (symmetric-memory static plans are captured only when forced)"
        # Large experts gain nothing (see the module docstring); LoRA experts keep graphs (grouped GEMMs).
        large = env.expert_elements >= LARGE_EXPERT_ELEMENTS and not env.lora_ranks
        graphs = graphs_blocker is None and not large
        reason = "auto" if graphs else f"auto: off, needs {graphs_blocker}"
        if graphs_blocker is None and not graphs:
            reason = (
                f"auto: off for large experts ({env.expert_elements / 1e6:.0f} M elements in one's gate/up weight): "
                "GPU-bound, and their backward runs cuBLAS per expert"
            )
        rows.append(Choice("cuda_graphs", _on(graphs), reason))

    single_rank = _single_rank_fsdp(execution.single_rank_fsdp, env, rows)
    if env.frozen_experts is not None:
        edp = env.num_nodes * env.devices_per_node // (env.replicate_degree * env.degree)
        split = f"; each expert's bytes split over {edp} ranks, gathered per layer" if edp > 1 else ""
        rows.append(Choice("frozen_experts", env.frozen_experts, FROZEN_FORMATS[env.frozen_experts] + split))
    if env.expert_gemms is not None:
        rows.append(Choice("expert_gemms", env.expert_gemms, EXPERT_GEMMS[env.expert_gemms]))

    fused_adamw, row = _fused_adamw(execution.fused_adamw, env)
    rows += row

    exchange: LayerExchange = "symmetric_memory" if symmetric else "collective"
    layers = LayerExecution(cuda_graphs=graphs, exchange=exchange, token_dedup=dedup, row_budget=budget)
    return Resolved(compile_on, layers, fused_adamw, env, tuple(rows), single_rank)


def with_optimizers(resolved: Resolved, execution: Execution, optimizers: tuple[str, ...]) -> Resolved:
    """``resolved`` once Lightning has set up ``optimizers`` (as ``Environment.optimizers`` names them), its
    ``fused_adamw`` row as ``resolve`` gives it for them. Raises ``ValueError`` where they contradict a forced value."""
    env = replace(resolved.environment, optimizers=optimizers)
    fused_adamw, row = _fused_adamw(execution.fused_adamw, env)
    choices = tuple(c for c in resolved.choices if c.name != "fused_adamw") + row  # the last row, as in resolve
    return replace(resolved, fused_adamw=fused_adamw, environment=env, choices=choices)


def _fused_adamw(option: bool | Auto, env: Environment) -> tuple[bool, tuple[Choice, ...]]:
    """``fused_adamw_row`` for ``env``: whether the kernels step, and the row (none before the optimizers)."""
    on, reason = fused_adamw_row(option, device_type=env.device_type, triton=env.triton, optimizers=env.optimizers)
    return on, () if reason is None else (Choice("fused_adamw", _on(on), reason),)


def _single_rank_fsdp(option: bool | Auto, env: Environment, rows: list[Choice]) -> bool:
    """Whether the dense parameters of a one-rank world skip FSDP2; adds its row."""
    blocker = None
    if env.world_size > 1:
        blocker = f"world size 1 ({env.world_size} here)"
    elif env.accumulate_grad_batches > 1:
        blocker = f"no gradient accumulation (accumulate_grad_batches={env.accumulate_grad_batches})"
    elif env.activation_checkpointing:
        blocker = "no activation checkpointing"
    elif env.reshard_after_forward is True:
        blocker = "no reshard_after_forward=True"
    if option is True and blocker is not None:
        raise ValueError(f"Execution(single_rank_fsdp=True) needs {blocker}; use single_rank_fsdp='auto'.")
    if option is not True and (option is False or blocker is not None):
        if env.world_size == 1:  # the row only where the choice could apply
            rows.append(Choice("single_rank_fsdp", "off", "forced" if option is False else f"auto: needs {blocker}"))
        return False
    reason = "one rank: dense parameters used in place, no FSDP2 copies (same bits)"
    rows.append(Choice("single_rank_fsdp", "on", "forced; " + reason if option is True else reason))
    return True


def _on(value: bool) -> str:
    return "on" if value else "off"


def _check_symmetric(env: Environment, moe: MoEConfig) -> None:
    problems = []
    if env.device_type != "cuda" or not env.triton:
        problems.append("CUDA with Triton")
    if moe.capacity_factor is not None or not moe.moe_all_to_all_dispatcher:
        problems.append("the dropless all-to-all (capacity_factor=None, moe_all_to_all_dispatcher=True)")
    if env.degree > env.devices_per_node:
        problems.append(
            f"every expert-parallel group on one node (degree {env.degree} > {env.devices_per_node} per node)"
        )
    if problems:
        raise ValueError(
            "Execution(exchange='symmetric_memory') needs " + " and ".join(problems) + "; use exchange='auto'."
        )
