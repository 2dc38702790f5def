"""Frozen routed-expert weights kept in FP8, MXFP4 or NF4, dequantized one layer at a time.

Legend: E experts, L experts held here, R x C one expert's matrix as the experts multiply by it.

A LoRA fine-tune (or one with frozen experts) never updates the expert weights, which are about 95%
of a large MoE's parameters; ``FrozenExpertWeight`` holds such a weight as buffers in a published
low-precision layout, with no gradient and no optimizer state:

- ``"fp8"``: ``data [E, R, C]`` (float8_e4m3fn values, held as their bytes, ``uint8``, which every
  collective and checkpoint writer takes) and ``scale_inv float32 [E, ceil(R/128), ceil(C/128)]``,
  one scale per 128 x 128 block as DeepSeek-V3 ships them, or per the folder's own block
  (``weight = data * scale_inv``); 1.0 byte an element and a 1/4096 of it in scales.
- ``"mxfp4"``: ``blocks uint8 [E, out, in/32, 16]`` (two E2M1 values a byte, low nibble first) and
  ``scales uint8 [E, out, in/32]`` (E8M0 exponents, one per 32 values along ``in``), as GPT-OSS ships
  them; 0.53 byte an element. ``in`` is the input features: ``C`` for ``[E, out, in]`` weights, ``R``
  for GPT-OSS's transposed ``[E, in, out]`` (``transposed=True``).
- ``"nf4"``: ``codes uint8 [E, out, in/64, 32]`` (two NF4 value indices a byte, low nibble first) and
  ``absmax float32 [E, out, in/64]`` (one per 64 values along ``in``), QLoRA's 4-bit NormalFloat
  with single-precision block scales (bitsandbytes' double-quantized scales are expanded to fp32 on
  load); 0.5625 byte an element. bitsandbytes' ``load_in_4bit`` releases ship it (per-expert layers).

The experts' forward asks each weight for ``dequantize()``: its local experts in the compute dtype,
a transient tensor. The autograd graph keeps no copy of it: ``recomputed_in_backward`` replaces every
saved view of it by a recipe that dequantizes it again when the backward reads it. A layer's
dequantized weights thus live during its forward and again during its backward, never between.

Weights published in higher precision are quantized (``moe.quantized``) expert by expert on the
rank that holds them; weights published in the format kept are copied as they are (``models.hf_io``).

Expert parallelism splits the buffers by expert (dim 0, on ``ep``); ``shard_model`` also splits dim 1
of each over the expert-data-parallel ranks (``FrozenExpertWeight.shard_rows_``), as FSDP2 splits the
trainable expert weights, and ``dequantize`` then gathers a weight's bytes with one all-gather, in
each forward and backward, not overlapped with compute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ep.moe.collectives import all_gather_single
from lightning_ep.moe.quantized import (
    FP8_BLOCK,
    MXFP4_GROUP,
    NF4_GROUP,
    dequantize_mxfp4,
    dequantize_nf4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nf4,
)

Format = Literal["fp8", "mxfp4", "nf4"]
FORMATS: tuple[str, ...] = get_args(Format)
#: Elements dequantized in fp32 at a time (whole experts): bounds the transient copy to 256 MiB.
DEQUANTIZE_ELEMENTS = 1 << 26
#: Bytes an element of each format takes, scales included (the planner's figure).
BYTES_PER_ELEMENT = {
    "fp8": 1.0 + 4.0 / (FP8_BLOCK[0] * FP8_BLOCK[1]),
    "mxfp4": 0.5 + 1.0 / MXFP4_GROUP,
    "nf4": 0.5 + 4.0 / NF4_GROUP,
}
#: Values along ``in`` per scale of the 4-bit formats, and their buffers: (value bytes, scales).
GROUPS = {
    "mxfp4": (MXFP4_GROUP, torch.uint8, ("blocks", "scales")),
    "nf4": (NF4_GROUP, torch.float32, ("codes", "absmax")),
}
#: Each format's buffers, by name.
BUFFERS = {"fp8": ("data", "scale_inv"), **{fmt: names for fmt, (_, _, names) in GROUPS.items()}}


def _local(t: torch.Tensor) -> torch.Tensor:
    from lightning_ep.moe.experts.grouped import local_tensor

    return local_tensor(t)


class FrozenExpertWeight(nn.Module):
    """One frozen routed-expert weight ``[E, R, C]`` (its global shape) kept in ``format`` (see the
    module docstring), its buffers sharded on the expert dim as the weight was (and on dim 1 after
    ``shard_rows_``). Answers ``shape``, ``ndim`` and ``requires_grad`` (``False``) as the weight did.

    Args:
        format: ``"fp8"``, ``"mxfp4"`` or ``"nf4"``.
        like: the weight it replaces (a Parameter, a DTensor sharded on dim 0, or on the meta device):
            its shape, placement and device; its values are quantized unless on the meta device.
        transposed: the weight is ``[E, in, out]`` (GPT-OSS); MXFP4 and NF4 groups run along ``in``.
        block: FP8's rows and columns per scale (a folder's ``weight_block_size``, kept as published).
    """

    requires_grad = False

    def __init__(
        self, format: Format, like: torch.Tensor, *, transposed: bool = False, block: tuple[int, int] = FP8_BLOCK
    ) -> None:
        super().__init__()
        if format not in FORMATS:
            raise ValueError(f"FrozenExpertWeight(format={format!r}): pass one of {list(FORMATS)}.")
        if like.ndim != 3:
            raise ValueError(f"FrozenExpertWeight: expert weights are [E, R, C], got {list(like.shape)}.")
        self.format, self.transposed, self.block = format, transposed, (int(block[0]), int(block[1]))
        self._rows_mesh: DeviceMesh | None = None  # set by shard_rows_
        self._rows_axis = "edp"
        self.global_shape = tuple(like.shape)
        experts, rows, cols = self.global_shape
        if format == "fp8":
            grid = (experts, -(-rows // self.block[0]), -(-cols // self.block[1]))
            specs = {"data": (self.global_shape, torch.uint8), "scale_inv": (grid, torch.float32)}
        else:
            out, inner = (cols, rows) if transposed else (rows, cols)
            group, scale_dtype, (values_name, scales_name) = GROUPS[format]
            if inner % group:
                raise ValueError(
                    f"frozen_experts={format!r} groups {group} input features a scale, but an expert weight "
                    f"{list(self.global_shape)} has {inner}; use frozen_experts='fp8' for this model."
                )
            specs = {
                values_name: ((experts, out, inner // group, group // 2), torch.uint8),
                scales_name: ((experts, out, inner // group), scale_dtype),
            }
        local = _local(like)
        for name, (shape, dtype) in specs.items():
            self.register_buffer(name, _like_placed(like, (local.shape[0], *shape[1:]), shape, dtype))
        if not like.is_meta:
            for e in range(local.shape[0]):
                self.store_(local[e : e + 1], e)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FrozenExpertWeight:
        """``Module.to`` / ``half`` / ``to_empty`` move the buffers but keep their dtypes: a cast would
        round the FP8 scales (fp32; ``bf16-true`` casts the whole model) and scramble the packed bytes."""
        for name, buffer in self._buffers.items():
            if buffer is not None:
                moved = fn(buffer)
                self._buffers[name] = moved if moved.dtype == buffer.dtype else buffer.to(device=moved.device)
        return self

    def get_extra_state(self) -> dict[str, object]:
        """What the state dict needs besides the buffers to read them back (``dequantize_stored``)."""
        return {"format": self.format, "transposed": self.transposed, "block": list(self.block)}

    def set_extra_state(self, state: dict[str, object]) -> None:
        if state != self.get_extra_state():
            raise ValueError(
                f"a frozen expert weight saved as {state} cannot load into one kept as {self.get_extra_state()}; "
                "resume with the frozen_experts format (and folder) the checkpoint was saved with."
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.global_shape)

    @property
    def ndim(self) -> int:
        return 3

    def held(self) -> dict[str, torch.Tensor]:
        """The blocks of the buffers this rank holds, by name: dim 1 of its experts' buffers whole, or
        the ``held_rows()`` of it once ``shard_rows_`` split it."""
        return {name: _local(b) for name, b in self.named_buffers(recurse=False)}

    def held_rows(self) -> dict[str, tuple[int, int]]:
        """Per buffer, the global range ``(start, stop)`` of its dim 1 held here."""
        from lightning_ep.parallel.mesh import local_block

        spans = {}
        for name, buffer in self.named_buffers(recurse=False):
            local, offset = local_block(buffer, "FrozenExpertWeight", name)
            spans[name] = (offset[1], offset[1] + local.shape[1])
        return spans

    def stored(self) -> dict[str, torch.Tensor]:
        """This rank's experts' buffers whole, by name: ``held()``, with the rows that the other ranks of
        ``shard_rows_``'s axis hold gathered by one all-gather of every buffer's bytes together."""
        held = self.held()
        if self._rows_mesh is None:
            return held
        rows = {name: buffer.shape[1] for name, buffer in self.named_buffers(recurse=False)}
        return _gather_rows(held, rows, self._rows_mesh.get_group(self._rows_axis))

    @torch.no_grad()
    def shard_rows_(self, mesh: DeviceMesh, axis: str = "edp") -> None:
        """Split dim 1 of every buffer over ``mesh[axis]``, as FSDP2 splits the trainable expert weights
        over the expert-data-parallel ranks (``shard_model`` calls it): the buffers become DTensors on
        ``mesh`` (``init_mesh``'s world mesh), ``Shard(0)`` on ``ep``, ``Shard(1)`` on ``axis``
        (torch.chunk's uneven split), replicated on the other axes. A rank then holds ``1 / size`` of
        its experts' bytes; ``dequantize`` gathers them. Works on the meta device; idempotent."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if self._rows_mesh is not None:
            return
        names = mesh.mesh_dim_names or ()
        placements = [Shard(0) if d == "ep" else Shard(1) if d == axis else Replicate() for d in names]
        for name, buffer in list(self._buffers.items()):
            assert buffer is not None
            shape = torch.Size(buffer.shape)
            local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            rows = _local(buffer)[:, offset[1] : offset[1] + local_shape[1]].clone()
            stride = torch.empty(shape, device="meta").stride()
            placed = DTensor.from_local(rows, mesh, placements, run_check=False, shape=shape, stride=stride)
            self._buffers[name] = placed
        self._rows_mesh, self._rows_axis = mesh, axis

    def value_region(self) -> tuple[int, int, int]:
        """``(dim, start, stop)``: the slice of the values ``[n, R, C]`` (along dim 1 or 2) that
        ``store_`` quantizes to fill the rows held here; whole FP8 blocks, so that their scales are the
        whole weight's. ``(1, 0, R)`` unless ``shard_rows_`` split the buffers."""
        spans = self.held_rows()
        if self.format in GROUPS:  # [E, out, G, ...]: ``out`` is R untransposed, C transposed
            return (2 if self.transposed else 1, *spans[BUFFERS[self.format][0]])
        (br, _), rows = self.block, self.global_shape[1]
        (a, b), (g0, g1) = spans["data"], spans["scale_inv"]
        needed = [(lo, hi) for lo, hi in ((a, b), (g0 * br, min(rows, g1 * br))) if lo < hi]
        if not needed:
            return (1, 0, 0)
        start = min(lo for lo, _ in needed) // br * br
        return (1, start, min(rows, -(-max(hi for _, hi in needed) // br) * br))

    @torch.no_grad()
    def store_(self, values: torch.Tensor, first: int) -> None:
        """Quantize ``values [n, ...]`` (any float dtype), the ``value_region()`` of local experts
        ``first .. first + n - 1`` (their whole ``[R, C]`` unless ``shard_rows_`` split the buffers), into
        the rows of them held here."""
        dim, start, stop = self.value_region()
        if values.shape[dim] != stop - start:
            raise ValueError(
                f"FrozenExpertWeight.store_: got values {list(values.shape)}, but this rank quantizes "
                f"{start}:{stop} of dim {dim} of {list(self.global_shape)}; pass value_region()'s slice."
            )
        if stop == start:
            return
        held, spans, experts = self.held(), self.held_rows(), slice(first, first + values.shape[0])
        if self.format == "fp8":
            data, scale_inv = quantize_fp8(values, self.block)
            (a, b), (g0, g1), grid0 = spans["data"], spans["scale_inv"], start // self.block[0]
            held["data"][experts] = data.view(torch.uint8)[:, a - start : b - start]
            held["scale_inv"][experts] = scale_inv[:, g0 - grid0 : g1 - grid0]
        else:
            # The 4-bit quantizers group along the last dim: ``in`` is C untransposed, R transposed.
            quantize = quantize_mxfp4 if self.format == "mxfp4" else quantize_nf4
            packed, scales = quantize(values if not self.transposed else values.transpose(-1, -2))
            values_name, scales_name = BUFFERS[self.format]
            held[values_name][experts], held[scales_name][experts] = packed, scales

    @torch.no_grad()
    def init_normal_(self, std: float) -> None:
        """Fill the local experts with ``normal(0, std)`` values, quantized one expert at a time. Every
        rank draws its experts whole and keeps its ``value_region()``: ranks that share the seed (and
        hold the same experts) draw the same values, so that split FP8 blocks and their scales agree."""
        first = next(iter(self.held().values()))
        dim, start, stop = self.value_region()
        for e in range(first.shape[0]):
            values = torch.randn(1, *self.global_shape[1:], device=first.device) * std
            self.store_(values.narrow(dim, start, stop - start), e)

    def dequantize(self, dtype: torch.dtype, experts: slice | None = None) -> torch.Tensor:
        """The local experts (``experts`` of them: all by default) as ``[L, R, C]`` in ``dtype``:
        exactly ``data * scale_inv`` / the E2M1 value times ``2^(scale - 127)``, computed in fp32.
        On CUDA one fused kernel per weight (``_fused``: the stored bytes read, ``dtype`` written);
        elsewhere ``DEQUANTIZE_ELEMENTS`` at a time (whole experts) through an fp32 copy."""
        stored = {name: t[experts or slice(None)] for name, t in self.stored().items()}
        first = next(iter(stored.values()))
        with torch.no_grad():
            fused = _fused() if first.is_cuda and not torch.compiler.is_compiling() else None
            if fused is not None:
                return fused(self.format, self.transposed, self.block, stored, dtype)
            out = torch.empty((first.shape[0], *self.global_shape[1:]), dtype=dtype, device=first.device)
            step = max(1, DEQUANTIZE_ELEMENTS // max(1, out[0].numel()))
            for start in range(0, first.shape[0], step):
                chunk = {name: t[start : start + step] for name, t in stored.items()}
                out[start : start + step] = dequantize_stored(self.format, self.transposed, self.block, chunk, dtype)
        return out

    def extra_repr(self) -> str:
        block = f", block={list(self.block)}" if self.format == "fp8" else ""
        return f"format={self.format}, shape={list(self.global_shape)}{block}" + (
            ", transposed" if self.transposed else ""
        )


def keep_frozen_experts(model: nn.Module, format: Format, *, block: tuple[int, int] = FP8_BLOCK) -> list[str]:
    """Replace the routed-expert weights (``gate_up_proj``, ``down_proj``) of every experts module of this
    library in ``model`` by ``FrozenExpertWeight``s in ``format``: after ``transform``, before FSDP2
    (``shard_model``) and before the weights are allocated (meta) or with their values (quantized here,
    one local expert at a time). ``block``: FP8's block, the folder's ``weight_block_size`` when it ships
    FP8 (the strategy passes it). Idempotent. Returns the names of the weights replaced.

    Raises ``ValueError`` naming the weight when a routed-expert weight requires grad (a weight that
    trains cannot be kept quantized), or when ``model`` holds no experts module of this library.
    """
    from lightning_ep.moe.experts.grouped import RoutedExperts

    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, RoutedExperts)]
    if not experts:
        raise ValueError(
            f"frozen_experts={format!r}: the {type(model).__name__} holds no routed experts of lightning_ep; "
            "transform it first (the strategy does), with a supported MoE family."
        )
    replaced = []
    for prefix, module in experts:
        for weight in ("gate_up_proj", "down_proj"):
            param = getattr(module, weight)
            if isinstance(param, FrozenExpertWeight):
                continue
            if param.requires_grad:
                raise ValueError(
                    f"frozen_experts={format!r} keeps frozen expert weights in {format}, but {prefix}.{weight} "
                    "trains (requires_grad=True). Freeze the experts first: train LoRA adapters (PEFT's "
                    "get_peft_model freezes the base weights) or call requires_grad_(False) on them in "
                    "configure_model; or drop frozen_experts to train them in full."
                )
            frozen = FrozenExpertWeight(format, param, transposed=module.transposed_weights, block=block)
            delattr(module, weight)
            setattr(module, weight, frozen)
            replaced.append(f"{prefix}.{weight}")
    return replaced


def dequantize_stored(
    format: str, transposed: bool, block: tuple[int, int], stored: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """Whole experts' stored buffers (``FrozenExpertWeight``'s, by name) as ``[n, R, C]`` values in
    ``dtype``, computed in fp32; ``format``, ``transposed`` and ``block`` as the weight's extra state."""
    if format == "fp8":
        return _dequantize_fp8(stored["data"], stored["scale_inv"], block).to(dtype)
    if format == "nf4":
        values = dequantize_nf4(stored["codes"], stored["absmax"], torch.float32)  # [n, out, in]
    else:
        values = dequantize_mxfp4(stored["blocks"], stored["scales"], torch.float32)
    return (values.transpose(-1, -2) if transposed else values).to(dtype)


@functools.cache
def _fused() -> Callable[..., torch.Tensor] | None:
    """``dequantize_stored`` compiled by Inductor, one Triton kernel per weight shape, or ``None`` without
    Triton. The eager path moves about 19 bytes an FP8 element (the fp32 copy written, scaled in place
    and cast); this one 3 (the byte read, bf16 written): the same fp32 products."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return torch.compile(dequantize_stored, dynamic=False)


def _dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data [n, R, C]`` (e4m3 bytes) times its block scales, in fp32: ``dequantize_fp8_block``'s
    products, with the scales repeated over rows only and broadcast over each block's columns."""
    (br, bc), cols = block, data.shape[-1]
    scale_rows = scale_inv.repeat_interleave(br, dim=-2)[..., : data.shape[-2], :]  # [n, R, ceil(C / bc)]
    values = data.view(torch.float8_e4m3fn).to(torch.float32)
    full = cols // bc
    if full:
        values[..., : full * bc].unflatten(-1, (full, bc)).mul_(scale_rows[..., :full, None])
    if cols % bc:
        values[..., full * bc :].mul_(scale_rows[..., full:])
    return values


def _gather_rows(
    held: dict[str, torch.Tensor], rows: dict[str, int], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """Each of ``held``'s blocks ``[L, r, ...]`` (dim 1 split as ``torch.chunk`` splits ``rows[name]``
    over ``group``) whole, ``[L, rows[name], ...]``: every block padded to the largest share, all of them
    packed as bytes into one buffer (each at a 16-byte offset), one all-gather, one copy out per buffer."""
    size = dist.get_world_size(group)
    slots, total = {}, 0
    for name, block in held.items():
        chunk = -(-rows[name] // size)
        nbytes = block.shape[0] * chunk * math.prod(block.shape[2:]) * block.element_size()
        slots[name], total = (total, chunk, nbytes), total + -(-nbytes // 16) * 16
    device = next(iter(held.values())).device
    send = torch.empty(total, dtype=torch.uint8, device=device)
    for name, block in held.items():
        offset, chunk, nbytes = slots[name]
        slot = send[offset : offset + nbytes].view(block.dtype).view(block.shape[0], chunk, *block.shape[2:])
        slot[:, : block.shape[1]].copy_(block)
    received = torch.empty(size * total, dtype=torch.uint8, device=device)
    all_gather_single(received, send, group=group)
    shares = received.view(size, total)
    out = {}
    for name, block in held.items():
        offset, chunk, nbytes = slots[name]
        shape = (block.shape[0], chunk, *block.shape[2:])
        parts = shares[:, offset : offset + nbytes].view(block.dtype).view(size, *shape)
        whole = parts.transpose(0, 1).reshape(shape[0], size * chunk, *shape[2:])
        out[name] = whole if size * chunk == rows[name] else whole[:, : rows[name]].contiguous()
    return out


def _like_placed(
    like: torch.Tensor, local_shape: Sequence[int], global_shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """An empty tensor of ``local_shape`` on ``like``'s device, a DTensor of ``global_shape`` placed as
    ``like`` when ``like`` is one (sharded on dim 0)."""
    local = torch.empty(tuple(local_shape), dtype=dtype, device=_local(like).device)
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=shape, stride=stride)


@contextmanager
def recomputed_in_backward(
    weights: Sequence[torch.Tensor], recompute: Sequence[Callable[[], torch.Tensor]]
) -> Iterator[None]:
    """Within the block, autograd saves no view of ``weights[k]`` (tensors made by ``recompute[k]()``):
    it keeps the view's geometry and rebuilds it from a fresh ``recompute[k]()`` when the backward reads
    it. Other saved tensors go to the hooks already in force (activation checkpointing's, which drop them
    until the recomputation), or are kept as usual."""
    # Keys only: the hooks outlive the block in the graph, and must not keep the weights alive.
    storages = {(w.untyped_storage().data_ptr(), w.dtype): k for k, w in enumerate(weights)}
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    outer = top(False) if top is not None else None
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor) -> object:
        k = storages.get((t.untyped_storage().data_ptr(), t.dtype)) if t.device.type != "meta" else None
        if k is not None:
            return _Recipe(k, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
        return t if outer_pack is None else outer_pack(t)

    def unpack(saved: object) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            return recompute[saved.k]().as_strided(saved.shape, saved.stride, saved.offset)
        return saved if outer_unpack is None else outer_unpack(saved)  # type: ignore[return-value]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclass(frozen=True)
class _Recipe:
    """A saved view of the ``k``-th weight, rebuilt from a fresh dequantization."""

    k: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


__all__ = [
    "BUFFERS",
    "BYTES_PER_ELEMENT",
    "FORMATS",
    "GROUPS",
    "Format",
    "FrozenExpertWeight",
    "dequantize_stored",
    "keep_frozen_experts",
    "recomputed_in_backward",
]
