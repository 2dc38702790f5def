"""``ExpertParallelStrategy``: expert parallelism + FSDP2 for Hugging Face MoE models in Lightning.

A thin layer over Lightning's ``ModelParallelStrategy``: it owns the ``("replicate", "edp", "ep")``
mesh, hands it to the module, and after ``configure_model`` transforms the MoE blocks, shards
everything with FSDP2, materialises meta weights, and then lets Lightning set up optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_ep.checkpoint import records as checkpoints
from lightning_ep.execution.choices import Execution, Resolved, with_optimizers
from lightning_ep.execution.environment import expert_lora_ranks, fsdp_options, optimizer_names, resolve_for
from lightning_ep.models.causal_mask import separate_packed_documents
from lightning_ep.models.init import materialize_if_meta
from lightning_ep.models.pretrained import published_fp8_block
from lightning_ep.models.registry import MoEShape
from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.experts.fp8 import use_fp8_gemms
from lightning_ep.moe.experts.frozen import keep_frozen_experts
from lightning_ep.moe.layer import MoELayer
from lightning_ep.parallel.balance import update_biases_after_each_step
from lightning_ep.parallel.compile import compile_for_training
from lightning_ep.parallel.dither import dither_master_weights
from lightning_ep.parallel.fsdp import (
    check_all_sharded,
    decoder_blocks,
    gradient_sync,
    shard_dense_modules,
    shard_model,
    shard_named_blocks,
)
from lightning_ep.parallel.mesh import check_layout, init_mesh
from lightning_ep.strategy.arguments import (
    check_arguments,
    check_devices,
    check_dither,
    check_expert_gemms,
    check_precision,
    enable_checkpointing,
)
from lightning_ep.strategy.errors import shown_once
from lightning_ep.strategy.model_selection import select
from lightning_ep.strategy.step_checks import StepChecks, mesh_aware
from lightning_ep.transform import check_config_in_force, check_execution_in_force, moe_layers, transform

if TYPE_CHECKING:
    import lightning.pytorch as pl

_DEFAULT_TIMEOUT = timedelta(minutes=30)


class ExpertParallelStrategy(ModelParallelStrategy):
    """Expert parallelism for the MoE blocks of a Hugging Face model, FSDP2 for everything else.

    The LightningModule builds its Hugging Face model in ``configure_model`` (on the meta device
    if it likes, under ``trainer.init_module(empty_init=True)``); training code is unchanged.

    Args:
        degree: expert-parallel degree ``d`` (ranks that split the experts of each layer). ``"auto"``
            picks it once the expert count is known (``lightning_ep.plan.auto``: on CUDA the smallest
            degree whose plan fits the device memory for ``plan_batch``, failing before any weight is
            materialised if none fits), so ``self.device_mesh`` is not available inside
            ``configure_model``; pass an int if the module needs it there.
        replicate_degree: HSDP replicate degree ``R``; the world is ``R * E_dp * d`` ranks.
        moe: routing, balancing and dispatch options (``MoEConfig``).
        activation_checkpointing: recompute each decoder layer in backward. ``"keep_all_to_all"`` keeps
            each MoE layer's dispatch plan and exchanged rows from the forward, so the recomputation
            makes no collective and no host sync (``M x H + N x H`` more elements per layer).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); ``False`` keeps them
            until backward (ZeRO-2: more memory, fewer all-gathers). ``None``: ZeRO-3, but kept at world
            size 1 (``Execution.single_rank_fsdp``).
        execution: how the step runs, never what it computes (``lightning_ep.Execution``); every
            choice is automatic by default and printed once at setup on rank 0.
        save_distributed_checkpoint: ``True`` saves one shard per rank (resumable at any degree);
            ``False`` gathers a single full checkpoint on rank 0. Either records ``moe`` and the MoE
            shape (``lightning_ep.checkpoint.records``).
        allow_moe_config_change: ``MoEConfig`` fields (``["moe_load_balancing"]`` to switch balancing
            for the next phase) or MoE shape entries that may differ from a resumed checkpoint's record;
            any other difference is refused before a weight is loaded.
        log_moe_losses: log the per-layer and total aux and z losses at each optimizer step (their
            mean over the step's micro-batches).
        check_finite: raise ``FloatingPointError`` naming the MoE layer and the step if a router logit
            or a layer output of a training forward was not finite, before the optimizer step; the
            flags ride on the loss-logging all-reduce (no stall between forward and backward).
        deterministic: ``torch.use_deterministic_algorithms(True)`` for the run; with the same seed,
            two CPU runs give bitwise-identical losses (see the README for GPU).
        tensor_parallel_size: must be 1; tensor parallelism alongside EP is not supported.
        process_group_backend: ``"nccl"``, ``"gloo"``, or ``None`` for the device's default.
        moe_model: attribute path of the Hugging Face MoE model to parallelise when the module holds
            several (``lightning_ep.strategy.model_selection``).
        plan_batch: ``(micro_batch, seq)`` per GPU that ``degree="auto"`` plans the memory for.
        frozen_experts: ``"fp8"``, ``"mxfp4"`` or ``"nf4"`` keeps the routed-expert weights, which must be
            frozen (a LoRA fine-tune's), in that format (``lightning_ep.moe.experts.frozen``): with no gradient
            or optimizer state, copied as published from an FP8 / MXFP4 folder, else quantized expert
            by expert on the rank that holds it; each layer dequantizes them into the compute dtype
            in its forward and again in its backward. ``None``: the parameters' dtype.
        expert_gemms: ``"fp8"`` runs the trainable experts' six GEMMs per layer in FP8 with dynamic
            row-wise scales (``lightning_ep.moe.experts.fp8``; a GPU of compute capability 9.0 or later,
            torchao, ``bf16-mixed`` or ``bf16-true``); the master weights keep their dtype. ``None``: the
            compute dtype's GEMMs.
        dither_master_weights: under ``bf16-mixed``, move each trainable fp32 master weight that was
            loaded from bf16 to a hashed point inside the interval that rounds to its bf16 value
            (``lightning_ep.parallel.dither``), once at setup: the forward's bf16 weights keep their
            bits, and small updates then reach the forward on average instead of only past half a
            bf16 step, so the run learns as fp32 does. The same masters at any degree.

    A configuration error is raised in full on rank 0 and as a one-line note on the other ranks
    (``lightning_ep.strategy.errors``), inside ``Trainer(...)`` already where it can.
    """

    def __init__(
        self,
        degree: int | Literal["auto"] = 1,
        *,
        replicate_degree: int = 1,
        moe: MoEConfig | None = None,
        activation_checkpointing: bool | Literal["keep_all_to_all"] = False,
        reshard_after_forward: bool | None = None,
        execution: Execution | None = None,
        save_distributed_checkpoint: bool = True,
        allow_moe_config_change: str | Sequence[str] = (),
        log_moe_losses: bool = True,
        check_finite: bool = True,
        deterministic: bool = False,
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        moe_model: str | None = None,
        plan_batch: tuple[int, int] = (1, 4096),
        frozen_experts: Literal["fp8", "mxfp4", "nf4"] | None = None,
        expert_gemms: Literal["fp8"] | None = None,
        dither_master_weights: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Under torchrun every rank builds the strategy: show a bad argument once (config_errors).
        # The process group does not exist yet; Lightning set this rank from the launcher's environment.
        with shown_once(int(getattr(rank_zero_only, "rank", 0))):
            check_arguments(
                degree=degree,
                replicate_degree=replicate_degree,
                moe=moe,
                execution=execution,
                timeout=timeout,
                activation_checkpointing=activation_checkpointing,
                tensor_parallel_size=tensor_parallel_size,
                moe_model=moe_model,
                frozen_experts=frozen_experts,
                expert_gemms=expert_gemms,
                dither_master_weights=dither_master_weights,
            )
            allowed = checkpoints.check_allowed(allow_moe_config_change)
        if moe is not None and not moe.smp_moe:
            degree = 1
        self._degree: int | Literal["auto"] = degree
        self.replicate_degree = replicate_degree
        self.moe = moe if moe is not None else MoEConfig()
        self.allow_moe_config_change = allowed
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.execution = execution if execution is not None else Execution()
        self.resolved: Resolved | None = None  # set at setup
        self.log_moe_losses = log_moe_losses
        self.check_finite = check_finite
        self.deterministic = deterministic
        self.moe_model = moe_model
        self.plan_batch = plan_batch
        self.frozen_experts = frozen_experts
        self.expert_gemms = expert_gemms
        self.dither_master_weights = dither_master_weights
        self._hf_model: nn.Module | None = None
        self._bias_hooks: list[RemovableHandle] = []
        self._step_checks = StepChecks(check_finite=check_finite, log_losses=log_moe_losses)

    @property
    def degree(self) -> int | Literal["auto"]:
        """The expert-parallel degree (an int once resolved)."""
        return self._degree

    @override
    def set_world_ranks(self) -> None:
        """Also check the layout and the precision against the Trainer's arguments (``Trainer.__init__``)."""
        super().set_world_ranks()
        with shown_once(self.global_rank):
            check_precision(self.precision_plugin.precision)
            if self.dither_master_weights:
                check_dither(self.precision_plugin.precision)
            if self._degree != "auto" and self.parallel_devices:
                check_devices(self._degree, self.replicate_degree, devices=self.num_processes, num_nodes=self.num_nodes)

    @override
    def setup_environment(self) -> None:
        if self.deterministic:
            torch.use_deterministic_algorithms(True)
        self._setup_distributed()
        if self._degree != "auto":
            self._build_mesh(self._degree)

    def _build_mesh(self, degree: int) -> None:
        with shown_once(self.global_rank):
            try:
                check_layout(self.world_size, degree, self.replicate_degree)
            except ValueError as error:
                raise ValueError(f"ExpertParallelStrategy: {error}") from None
        self._degree = degree
        self._device_mesh = init_mesh(degree, replicate_degree=self.replicate_degree, device_type=self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _auto_degree(self, hf_model: nn.Module) -> int:
        from lightning_ep.plan.auto import auto_degree

        ac, cf, n, r = self.activation_checkpointing, self.moe.capacity_factor, self.num_processes, self.global_rank
        experts = MoEShape.of(hf_model).num_experts
        assert experts is not None  # select() found the model's MoE blocks
        return auto_degree(
            hf_model, num_experts=experts, world_size=self.world_size, devices_per_node=n,
            replicate_degree=self.replicate_degree, device=self.root_device, precision=self.precision_plugin.precision,
            plan_batch=self.plan_batch, activation_checkpointing=ac, capacity_factor=cf, rank=r,
            lora_rank=max(expert_lora_ranks(hf_model), default=0), frozen_experts=self.frozen_experts,
            fp8_block=published_fp8_block(hf_model),
        )  # fmt: skip

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank, EP ranks included, is a data-parallel rank with its own data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        with shown_once(self.global_rank):  # the module's structure is the same on every rank
            on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
            if on_meta and not is_overridden("configure_model", module):
                raise TypeError(
                    f"{type(module).__name__} holds meta-device weights but does not override configure_model(); "
                    "build the Hugging Face model inside configure_model() so the strategy can shard and "
                    "materialise it."
                )
            selection = select(module, self.moe_model, smp_moe=self.moe.smp_moe)
            degree = self._auto_degree(selection.model) if self._degree == "auto" else None
        if degree is not None:
            self._build_mesh(degree)
        with shown_once(self.global_rank):
            self.resolved = resolve_for(self, selection.model)
        self._parallelize(selection.model)
        shard_dense_modules(list(selection.extras.values()), self.device_mesh, **fsdp_options(self))
        # The parameters' dtype under the Trainer's precision (``*-mixed``: fp32 master weights).
        dtypes = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
        dtype = dtypes.get(str(getattr(self.precision_plugin, "precision", "32-true")), torch.float32)
        for part in (selection.model, *selection.others.values(), *selection.extras.values()):
            materialize_if_meta(part, self.root_device, pretrained_dtype=dtype)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        check_all_sharded(module)
        if self.dither_master_weights:
            _dither(module)
        # Lightning divides the loss by accumulate_grad_batches; the router losses must follow.
        scale = 1.0 / trainer.accumulate_grad_batches if module.automatic_optimization else 1.0
        for layer in self._layers():
            layer.loss_scale = scale
            layer.check_finite = self.check_finite
            layer.keep_all_to_all = self.activation_checkpointing == "keep_all_to_all"
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            with shown_once(self.global_rank):  # every rank sets up optimizers of the same classes
                self.resolved = with_optimizers(self.resolved, self.execution, optimizer_names(self.optimizers))
            self._bias_hooks = update_biases_after_each_step(self.optimizers, selection.model)
        rank_zero_info(self.resolved.table())  # once the optimizers exist: the fused_adamw row reports them
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:  # as ModelParallelStrategy.setup, but not steps and DTensors
            for state in [s for optimizer in self.optimizers for s in optimizer.state.values()]:
                for key, value in state.items():
                    if key != "step" and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                        state[key] = value.to(self.root_device)
        self._step_checks.release()
        self._step_checks = StepChecks(
            check_finite=self.check_finite, log_losses=self.log_moe_losses, precision=self.precision_plugin.precision
        )
        assert self._hf_model is not None
        self._step_checks.watch_budgets(self._layers(), self._hf_model)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        return ModelParallelStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's plugin for the Trainer's precision, as its subclass that clips gradients across
        meshes (``lightning_ep.strategy.step_checks.mesh_aware``)."""
        ModelParallelStrategy.precision_plugin.fset(self, None if plugin is None else mesh_aware(plugin))  # type: ignore[attr-defined]

    def _parallelize(self, hf_model: nn.Module) -> None:
        """Transform, optionally checkpoint, and shard ``hf_model`` (idempotent). Packed rows are masked
        per document in every case, the model's own MoE blocks (``smp_moe=False``) included."""
        self._hf_model = hf_model
        separate_packed_documents(hf_model)
        with shown_once(self.global_rank):
            fix = "drop the transform() call (the strategy transforms with its moe=) or pass it the same config"
            check_config_in_force(hf_model, self.moe, asked_by="ExpertParallelStrategy(moe=...)", fix=fix)
            if self.resolved is not None:
                check_execution_in_force(hf_model, self.resolved.layers)
        if any(isinstance(p, DTensor) for p in hf_model.parameters()):
            return
        mesh = self.device_mesh
        if self.expert_gemms is not None:
            with shown_once(self.global_rank):
                check_expert_gemms(self.expert_gemms, self.root_device, self.precision_plugin.precision)
        if self.activation_checkpointing:
            enable_checkpointing(hf_model, self.activation_checkpointing)
        single_rank = self.resolved is not None and self.resolved.single_rank_fsdp
        if self.moe.smp_moe:
            with shown_once(self.global_rank):  # a degree that does not divide the expert count
                execution = self.resolved.layers if self.resolved is not None else None
                transform(hf_model, self.moe, mesh=mesh, execution=execution)
                if self.frozen_experts is not None:
                    keep_frozen_experts(hf_model, self.frozen_experts, block=published_fp8_block(hf_model))
                if self.expert_gemms == "fp8":
                    use_fp8_gemms(hf_model)
            shard_model(hf_model, mesh, **fsdp_options(self), in_place_on_one_rank=single_rank)
            blocks = decoder_blocks(hf_model)
        else:
            blocks = shard_named_blocks(hf_model, mesh, **fsdp_options(self), in_place_on_one_rank=single_rank)
        if self.resolved is not None and self.resolved.compile:
            compile_for_training(hf_model, blocks)

    def _layers(self) -> list[MoELayer]:
        return moe_layers(self._hf_model) if self._hf_model is not None else []

    @override
    def teardown(self) -> None:
        for layer in self._layers():  # CUDA graphs hold the NCCL communicator (Execution.cuda_graphs)
            layer.release_graphs()
        for handle in self._bias_hooks:  # a later fit's optimizers get their own
            handle.remove()
        self._step_checks.release()
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save atomically (``<path>.partial``, then renamed) with the MoE record that ``load_checkpoint``
        checks before restoring any weight (``lightning_ep.checkpoint.records``)."""
        path = Path(self.broadcast(str(filepath)))
        partial = checkpoints.partial_path(path)
        if self.is_global_zero:
            checkpoints.remove(partial)
        self.barrier()
        if self._hf_model is not None:
            checkpoint[checkpoints.RECORD_KEY] = checkpoints.make_record(self.moe, self._hf_model)
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.is_global_zero:
            checkpoints.move_into_place(partial, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        checkpoints.refuse_partial(path)
        # Before any weight is restored: a resume under another MoE configuration is refused by name,
        # once for the job (every rank reads the same record).
        with shown_once(self.global_rank):
            record = checkpoints.read_record(path, weights_only)
            if self._hf_model is not None:
                checkpoints.check_record(
                    record, self.moe, self._hf_model, allowed=self.allow_moe_config_change, path=path
                )
        try:
            with checkpoints.saved_bias_keys(record, self._layers()):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except (ValueError, RuntimeError, KeyError, CheckpointException) as error:  # DCP's is a BaseException
            clear = checkpoints.different_model_error(path, error)
            if clear is None:
                raise
            raise clear from error

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip FSDP2 gradient reduction on the non-final micro-batches of gradient accumulation."""
        if self._hf_model is None:
            yield None
            return
        module = self.lightning_module if self.lightning_module is not None else self._hf_model
        gradient_sync(module, False)  # the MoE model and the extra modules sharded beside it
        try:
            yield None
        finally:
            gradient_sync(module, True)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.lightning_module is not None:
            self._step_checks.after_forward(self._layers(), self.lightning_module, self.root_device)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The precision plugin's step, with ``StepChecks`` run after its closure (forward and backward)."""

        def checked() -> Any:
            result = closure()
            self._step_checks.before_optimizer_step(self.lightning_module)
            return result

        return super().optimizer_step(optimizer, checked, model, **kwargs)


def _dither(module: nn.Module) -> None:
    """``dither_master_weights`` at setup, said on rank 0; a warning when no master lies on the bf16 grid."""
    count, moved = dither_master_weights(module.named_parameters())
    if count:
        rank_zero_info(
            f"dither_master_weights: {count} fp32 master weights loaded from bf16 ({moved:,} elements on rank 0) "
            "moved inside their bf16 rounding intervals."
        )
    else:
        rank_zero_warn(
            "ExpertParallelStrategy(dither_master_weights=True): no trainable fp32 parameter holds bf16 values "
            "(none was loaded from a bf16 checkpoint), so nothing was dithered."
        )
