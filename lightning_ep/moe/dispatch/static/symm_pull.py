"""Rows read straight from the other GPUs of one node, through CUDA symmetric memory.

Every rank of an expert-parallel group maps one buffer (``SymmetricWorkspace``) of every other
rank into its own address space (``torch.distributed._symmetric_memory``), so a kernel on rank
``r`` can load a row that rank ``s`` wrote, over NVLink, with an ordinary load. The three pull
kernels here gather rows that way (``symmetric`` builds the dispatch on them); ``copy_live_rows``
puts a padded plan's rows into this rank's own buffer.

One exchange is always: each rank writes its own buffer, ``barrier()`` (a device-side barrier on
the current stream: no host sync), each rank reads the others' buffers. No kernel here writes
another GPU's memory (remote stores would need a fence of their own before the barrier's signal).

A rank never writes a region while another may still read the last exchange's contents in it:
every exchange has its own barrier, which a rank only reaches once its reads of the exchange
before are done (stream order), and no exchange writes a region the exchange right before it
reads (dispatch: tokens and order; combine: rows; combine backward: tokens, order, weights,
grad_w; dispatch backward: rows; they alternate). For that, the regions keep fixed offsets, the
same for every layer, until the buffer grows (after a barrier).

Region offsets are in bytes from the start of every rank's buffer and the same on every rank; a
kernel finds rank ``s``'s copy of a region at ``bases[s] + offset``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

#: Elements of a row per program. Equal to ``combine._BLOCK_H``: the weight gradients' dot products
#: then reduce in the same order as the fused combine's, so both give the same bits.
BLOCK_H = 1024
#: Elements per program of the kernels that only move rows (``pull_rows``, ``copy_live_rows``).
MOVE_BLOCK_H = 2048
_ALIGN = 256
_GROWTH = 1.25


#: The workspace's regions: the tokens ``[T, H]`` and sorted pairs (int32 ``[N]``) a rank offers to
#: the dispatch's pull, the rows ``[M, H]`` it offers to the combine's (and the dispatch backward's),
#: the routing weights (fp32 ``[N]``) and the weight gradients of its rows (fp32 ``[M]``).
REGIONS = ("tokens", "rows", "order", "weights", "grad_w")


def align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Each region's start, ``REGIONS`` in order with ``sizes`` bytes each, and the ``"total"`` (>= ``_ALIGN``)."""
    at, offset = {}, 0
    for name in REGIONS:
        at[name] = offset
        offset += sizes[name]
    at["total"] = max(offset, _ALIGN)
    return at


def region_sizes(tokens: int, rows: int, top_k: int, hidden: int, element_size: int) -> dict[str, int]:
    """Bytes each region needs for ``tokens`` per rank and ``rows`` received."""
    pairs = tokens * top_k
    return {
        "tokens": tokens * hidden * element_size,
        "rows": rows * hidden * element_size,
        "order": pairs * 4,
        "weights": pairs * 4,
        "grad_w": rows * 4,
    }


class SymmetricWorkspace:
    """One symmetric-memory buffer per (process group, device), shared by every MoE layer. Its
    regions have fixed offsets (``at``) between growths, whatever the layer: a region's bytes are
    only ever that region's, so the exchanges of different layers never overlap in the buffer.
    ``reserve`` reallocates it when a region is too small (every region then gets 1.25 times what
    the call asked, or keeps its size if larger); every rank of the group calls it with the same
    sizes at the same point (the largest of any rank, from the counts all ranks gathered), since
    allocating is a collective rendezvous, so the offsets agree on every rank.
    """

    _instances: ClassVar[dict[tuple[str, int], SymmetricWorkspace]] = {}

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        #: Bytes of each region, and their offsets in every rank's buffer (with the total).
        self.sizes = dict.fromkeys(REGIONS, 0)
        self.at = dict.fromkeys((*REGIONS, "total"), 0)
        self.buffer: torch.Tensor | None = None
        self.handle: Any = None
        #: int64 ``[D]``: the address of every rank's buffer, as mapped on this rank.
        self.bases: torch.Tensor | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, device: torch.device) -> SymmetricWorkspace:
        key = (group.group_name, device.index if device.index is not None else torch.cuda.current_device())
        if key not in cls._instances:
            cls._instances[key] = cls(group, device)
        return cls._instances[key]

    def reserve(self, sizes: dict[str, int]) -> None:
        """Make every region hold at least ``sizes[region]`` bytes (collective when it grows)."""
        if all(sizes[name] <= self.sizes[name] for name in REGIONS):
            return
        from torch.distributed import _symmetric_memory as symm_mem

        if self.handle is not None:
            self.handle.barrier(channel=0)  # every rank is done reading the old buffer
        self.sizes = {name: max(self.sizes[name], align(int(sizes[name] * _GROWTH))) for name in REGIONS}
        self.at = offsets(self.sizes)
        size = self.at["total"]
        buffer = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        try:
            handle = symm_mem.rendezvous(buffer, self.group)
        except RuntimeError as error:
            raise RuntimeError(
                "Execution(exchange='symmetric_memory') could not map the other GPUs' memory "
                f"({error}); it needs every rank of the expert-parallel group on one node, with peer "
                "access (NVLink) between the GPUs. Use exchange='collective'."
            ) from error
        world = dist.get_world_size(self.group)
        pointers = [handle.get_buffer(r, (size,), torch.uint8).data_ptr() for r in range(world)]
        self.bases = torch.tensor(pointers, dtype=torch.int64, device=self.device)
        self.buffer, self.handle = buffer, handle

    def region(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's own region ``name`` (from its first byte) as a ``shape`` tensor of ``dtype``;
        an error if it does not fit, rather than a write into the next region."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is None or nbytes > self.sizes[name]:
            raise RuntimeError(
                f"the symmetric-memory workspace's region {name!r} holds {self.sizes[name]} bytes, but a {list(shape)} "
                f"{dtype} tensor needs {nbytes}: an exchange larger than the dispatch sized the buffer for (its rows "
                "wider, or of a wider dtype, than the tokens it dispatched). Please report it; "
                "exchange='collective' avoids it."
            )
        return self.buffer[self.at[name] : self.at[name] + nbytes].view(dtype).view(shape)

    def barrier(self) -> None:
        """Every rank's writes so far are visible to every rank after this (stream-ordered)."""
        self.handle.barrier(channel=0)


def pull_rows(
    ws: SymmetricWorkspace,
    tokens_at: int,
    order_at: int,
    src_M: torch.Tensor,
    pos_M: torch.Tensor,
    out_MH: torch.Tensor,
    top_k: int,
) -> None:
    """``out[m] = tokens_s[order_s[pos[m]] // K]`` with ``s = src[m]``, read from rank ``s``'s
    regions at ``tokens_at`` (rows ``[T_s, H]``) and ``order_at`` (int32: rank ``s``'s sorted pairs).
    Rows with ``src[m] = -1`` (padding) are left as they are."""
    rows, hidden = out_MH.shape
    if rows and hidden:
        grid = (rows, -(-hidden // MOVE_BLOCK_H))
        _triton().pull_rows[grid](
            ws.bases, tokens_at, order_at, src_M, pos_M, out_MH, H=hidden, K=top_k, BLOCK_H=MOVE_BLOCK_H
        )


def copy_live_rows(dst_MH: torch.Tensor, src_MH: torch.Tensor, src_M: torch.Tensor) -> None:
    """``dst[m] = src[m]`` for the rows with ``src_M[m] >= 0``; a static plan's padding rows (source
    -1, the last ``R - M`` of its ``R``) are neither read nor written. Into this rank's own region,
    before the barrier that offers it to the other ranks: a padded plan copies ``M`` rows, not ``R``."""
    rows, hidden = src_MH.shape
    if rows and hidden:
        grid = (rows, -(-hidden // MOVE_BLOCK_H))
        _triton().copy_live_rows[grid](src_M, src_MH, dst_MH, H=hidden, BLOCK_H=MOVE_BLOCK_H)


def pull_sum(
    ws: SymmetricWorkspace,
    rows_at: int,
    src_TK: torch.Tensor,
    row_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    out_TH: torch.Tensor,
) -> None:
    """``out[t] = sum_k w[t, k] * rows_d[row[t, k]]`` with ``d = src[t, k]`` (``w = 1`` without
    weights), summed in fp32 in the order of ``k`` and rounded once: the combine kernel's arithmetic.
    A term with ``row[t, k] = -1`` is left out."""
    tokens, hidden = out_TH.shape
    if tokens and hidden:
        grid = (tokens, -(-hidden // BLOCK_H))
        weighted = weights_TK is not None
        _triton().pull_sum[grid](
            ws.bases,
            rows_at,
            src_TK,
            row_TK,
            weights_TK if weighted else src_TK,
            out_TH,
            H=hidden,
            K=src_TK.shape[1],
            BLOCK_H=BLOCK_H,
            WEIGHTED=weighted,
        )


def pull_combine_backward(
    ws: SymmetricWorkspace,
    at: dict[str, int],
    src_M: torch.Tensor,
    pos_M: torch.Tensor,
    y_MH: torch.Tensor,
    grad_y_MH: torch.Tensor,
    grad_w_M: torch.Tensor,
    top_k: int,
) -> None:
    """For each local row ``m`` of pair ``p = order_s[pos[m]]`` of rank ``s = src[m]``:
    ``grad_y[m] = w_s[p] * g_s[p // K]`` and ``grad_w[m] = <g_s[p // K], y[m]>`` in fp32 (the fused
    combine's products and sums). ``g`` (``[T_s, H]``), ``order`` and ``w`` (fp32) are read from
    rank ``s``'s regions ``at["tokens"]``, ``at["order"]``, ``at["weights"]``. Padding rows
    (``src[m] = -1``) are left as they are."""
    rows, hidden = y_MH.shape
    if rows:
        _triton().pull_combine_backward[(rows,)](
            ws.bases,
            at["tokens"],
            at["order"],
            at["weights"],
            src_M,
            pos_M,
            y_MH,
            grad_y_MH,
            grad_w_M,
            H=hidden,
            K=top_k,
            BLOCK_H=BLOCK_H,
        )


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def pull_rows_kernel(
        bases_ptr,
        tokens_at,
        order_at,
        src_ptr,
        pos_ptr,
        out_ptr,
        H: tl.constexpr,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (row, block of H). Rank s's region at byte offset o: bases[s] + o.
        # A row with source -1 is padding (a static plan): nothing is read or written.
        m = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        src = tl.load(src_ptr + m)
        live = src >= 0
        mask = (offs < H) & live
        base = tl.load(bases_ptr + tl.maximum(src, 0))
        order = (base + order_at).to(tl.pointer_type(tl.int32))
        pair = tl.load(order + tl.load(pos_ptr + m), mask=live, other=0).to(tl.int64)
        tokens = (base + tokens_at).to(tl.pointer_type(out_ptr.dtype.element_ty))
        x = tl.load(tokens + (pair // K) * H + offs, mask=mask)
        tl.store(out_ptr + m * H + offs, x, mask=mask)

    @triton.jit
    def copy_live_rows_kernel(src_ptr, x_ptr, out_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs < H) & (tl.load(src_ptr + m) >= 0)
        tl.store(out_ptr + m * H + offs, tl.load(x_ptr + m * H + offs, mask=mask), mask=mask)

    @triton.jit
    def pull_sum_kernel(
        bases_ptr,
        rows_at,
        src_ptr,
        row_ptr,
        w_ptr,
        out_ptr,
        H: tl.constexpr,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        WEIGHTED: tl.constexpr,
    ):
        # One program per (token, block of H); the same sum as combine_forward. A row of -1 (a pair
        # past a static plan's budget) adds nothing.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):
            d = tl.load(src_ptr + t * K + k)
            row = tl.load(row_ptr + t * K + k).to(tl.int64)
            rows = (tl.load(bases_ptr + d) + rows_at).to(tl.pointer_type(out_ptr.dtype.element_ty))
            y = tl.load(rows + row * H + offs, mask=mask & (row >= 0), other=0.0)
            if WEIGHTED:
                acc += tl.load(w_ptr + t * K + k).to(tl.float32) * y.to(tl.float32)
            else:
                acc += y.to(tl.float32)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def pull_combine_backward_kernel(
        bases_ptr,
        tokens_at,
        order_at,
        weights_at,
        src_ptr,
        pos_ptr,
        y_ptr,
        gy_ptr,
        gw_ptr,
        H: tl.constexpr,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per local row; the same products and sums as combine_backward. A padding
        # row (source -1) reads and writes nothing.
        m = tl.program_id(0).to(tl.int64)
        src = tl.load(src_ptr + m)
        live = src >= 0
        base = tl.load(bases_ptr + tl.maximum(src, 0))
        pos = tl.load(pos_ptr + m)
        pair = tl.load((base + order_at).to(tl.pointer_type(tl.int32)) + pos, mask=live, other=0).to(tl.int64)
        w = tl.load((base + weights_at).to(tl.pointer_type(tl.float32)) + pair, mask=live, other=0.0)
        g_row = (base + tokens_at).to(tl.pointer_type(gy_ptr.dtype.element_ty)) + (pair // K) * H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            mask = (offs < H) & live
            g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + m * H + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(gy_ptr + m * H + offs, (w * g).to(gy_ptr.dtype.element_ty), mask=mask)
            acc += g * y
        tl.store(gw_ptr + m, tl.sum(acc, axis=0), mask=live)

    class Kernels:
        pull_rows = pull_rows_kernel
        copy_live_rows = copy_live_rows_kernel
        pull_sum = pull_sum_kernel
        pull_combine_backward = pull_combine_backward_kernel

    return Kernels


_triton = lazy_kernels(_build_kernels)
