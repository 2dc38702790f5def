"""Sinkhorn balancing of router logits as one Triton kernel launch (CUDA, fp32).

Legend: T tokens, E experts, B row blocks of ``BLOCK_T`` tokens, G programs.

``router.sinkhorn_log`` in torch launches about a dozen small kernels per iteration, which on a
fine-grained model costs more host time than the layer's grouped GEMMs. Here it is one cooperative
launch of ``G <= B`` programs, all resident on the GPU at once (the driver guarantees it or refuses
the launch), each owning the row blocks ``g, g + G, ...``. Every iteration, each program combines
the column partials ``(max, sum of exp)`` that every block wrote in the previous one into the column
scaling ``log v_E = log(T / E) - logsumexp_t(l + log u)``, rescales the rows of its blocks,
``log u_t = -logsumexp_e(l_te + log v_e)``, writes their column partials of ``l + log u`` (two
buffers, alternating), and waits at a grid barrier (one atomic increment of a counter, plain loads
of it until it is full, one acquiring atomic read).

A last pass writes ``l + log u + log v``. Padded rows keep ``log u = -inf``, out of every column sum,
and the columns then target ``N / E`` for the ``N`` real tokens. The torch version's log-domain
arithmetic in another order: the results agree to fp32 rounding. A program that owns one block
(``B <= G``) keeps its logits and ``log u`` in registers, else they are read again from L2 every
iteration. The host launches once and reads nothing back.
"""

from __future__ import annotations

import importlib.util
import math
import types
from typing import Any

import torch

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

# Rows x experts of one row block: the small size where every program then owns one block (its logits
# kept in registers), else the large one. With 8 warps a program holds its block and two chunks of
# partials (blocks x experts combined at once) in at most _HELD elements, about 160 registers a thread.
_BLOCK_ELEMENTS = (8192, 16384)
_HELD = 40960


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def sinkhorn(
        logits, log_u, part_m, part_s, out, counter, T, E, num_blocks, log_target, valid, real_target,
        ITERATIONS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
        NUM_CHUNKS: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        program, programs = tl.program_id(0), tl.num_programs(0)
        if MASKED:  # padded rows: log u = -inf, out of every column sum; the columns target N / E
            log_target = tl.load(real_target)
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < E
        part_size = num_blocks * E
        log_v = tl.zeros((BLOCK_E,), tl.float32)
        # With one block per program, its logits and log u stay in registers across the iterations.
        offs_own = program * BLOCK_T + tl.arange(0, BLOCK_T)
        own = tl.full((BLOCK_T, BLOCK_E), float("-inf"), tl.float32)
        if BLOCKS_PER_PROGRAM == 1:
            own_mask = (offs_own < T)[:, None] & mask_e[None, :]
            own = tl.load(logits + offs_own[:, None] * E + offs_e[None, :], mask=own_mask, other=float("-inf"))
        own_u = tl.zeros((BLOCK_T,), tl.float32)
        # Iterations 0 .. ITERATIONS - 1 rescale; the pass after them writes the result.
        for it in range(ITERATIONS + 1):
            if it > 0:
                # log v_e from every block's (max, sum of exp) of column e, written last iteration.
                # NUM_CHUNKS is a power of two (few compilations as T varies; a loop bound from a scalar
                # argument fails in Triton's CPU interpreter).
                read = ((it - 1) % 2) * part_size
                run_m = tl.full((BLOCK_E,), float("-inf"), tl.float32)
                run_s = tl.zeros((BLOCK_E,), tl.float32)
                for chunk in range(NUM_CHUNKS):
                    offs_b = chunk * CHUNK + tl.arange(0, CHUNK)
                    part_mask = (offs_b[:, None] < num_blocks) & mask_e[None, :]
                    part_index = read + offs_b[:, None] * E + offs_e[None, :]
                    m = tl.load(part_m + part_index, mask=part_mask, other=float("-inf"), cache_modifier=".cg")
                    s = tl.load(part_s + part_index, mask=part_mask, other=0.0, cache_modifier=".cg")
                    new_m = tl.maximum(run_m, tl.max(m, axis=0))
                    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
                    run_s = run_s * tl.exp(run_m - safe_m) + tl.sum(s * tl.exp(m - safe_m[None, :]), axis=0)
                    run_m = new_m
                log_v = log_target - (run_m + tl.log(run_s))
            write = (it % 2) * part_size
            for j in range(BLOCKS_PER_PROGRAM):
                block = program + j * programs
                offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
                mask_t = offs_t < T
                mask = mask_t[:, None] & mask_e[None, :]
                index = offs_t[:, None] * E + offs_e[None, :]
                if BLOCKS_PER_PROGRAM == 1:
                    x = own
                else:
                    x = tl.load(logits + index, mask=mask, other=float("-inf"))
                if it == ITERATIONS:
                    if BLOCKS_PER_PROGRAM == 1:
                        u = own_u
                    else:
                        u = tl.load(log_u + offs_t, mask=mask_t, other=0.0)
                    tl.store(out + index, x + u[:, None] + log_v[None, :], mask=mask)
                else:
                    # Rows: log u_t = -logsumexp_e(l_te + log v_e).
                    y = tl.where(mask, x + log_v[None, :], float("-inf"))
                    row_m = tl.max(y, axis=1)
                    safe_row = tl.where(mask_t, row_m, 0.0)
                    u = -(safe_row + tl.log(tl.sum(tl.exp(y - safe_row[:, None]), axis=1)))
                    if MASKED:
                        real_t = tl.load(valid + offs_t, mask=mask_t, other=0) != 0
                        u = tl.where(real_t, u, float("-inf"))
                    if BLOCKS_PER_PROGRAM == 1:
                        own_u = u
                    else:
                        tl.store(log_u + offs_t, u, mask=mask_t)
                    # This block's column partials of l + log u.
                    z = tl.where(mask, x + u[:, None], float("-inf"))
                    col_m = tl.max(z, axis=0)
                    safe_col = tl.where(col_m == float("-inf"), 0.0, col_m)
                    col_s = tl.sum(tl.exp(z - safe_col[None, :]), axis=0)
                    block_mask = mask_e & (block < num_blocks)
                    tl.store(part_m + write + block * E + offs_e, col_m, mask=block_mask)
                    tl.store(part_s + write + block * E + offs_e, col_s, mask=block_mask)
            if it < ITERATIONS:
                # Grid barrier: every program's partials are written before any program reads them.
                tl.debug_barrier()
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
                target = (it + 1) * programs
                if arrived < target:  # poll with plain loads (no read-modify-write traffic), then acquire
                    while arrived < target:
                        arrived = tl.load(counter, volatile=True)
                    tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()

    return types.SimpleNamespace(sinkhorn=sinkhorn)


_triton = lazy_kernels(_build)


def fused_sinkhorn_available(logits_TE: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``logits_TE``: fp32 on CUDA with Triton importable; under
    ``torch.compile`` too, as the custom operator ``lightning_ep::sinkhorn_log`` that Inductor calls
    instead of tracing the torch version's iterations."""
    return logits_TE.is_cuda and logits_TE.dtype == torch.float32 and _TRITON


#: Whether Triton can be imported, as a plain constant that ``torch.compile`` reads without tracing.
_TRITON = importlib.util.find_spec("triton") is not None


def sinkhorn_log_fused(
    logits_TE: torch.Tensor, iterations: int, valid_T: torch.Tensor | None = None, *, programs: int | None = None
) -> torch.Tensor:
    """``router.sinkhorn_log(logits_TE, iterations, valid_T)`` in one kernel launch: fp32 ``[T, E]``
    logits on CUDA (or on CPU under Triton's interpreter), ``T >= 1``, ``iterations >= 1`` -> a new
    ``[T, E]`` fp32 tensor of log-scores (no gradient). ``programs``: how many programs share the row
    blocks (default: one per block, at most one per multiprocessor); 1 under Triton's interpreter.
    """
    return _sinkhorn_op(logits_TE.detach(), iterations, valid_T, 0 if programs is None else programs)


@torch.library.custom_op("lightning_ep::sinkhorn_log", mutates_args=())
def _sinkhorn_op(logits_TE: torch.Tensor, iterations: int, valid_T: torch.Tensor | None, programs: int) -> torch.Tensor:
    """The launch (``programs`` 0: the default count), an operator that ``torch.compile`` keeps whole."""
    logits_TE = logits_TE.contiguous()
    num_tokens, num_experts = logits_TE.shape
    block_e = triton_next_power_of_2(num_experts)
    device = logits_TE.device
    most = programs or torch.cuda.get_device_properties(device).multi_processor_count
    for elements in _BLOCK_ELEMENTS:
        block_t = max(1, min(triton_next_power_of_2(num_tokens), elements // block_e))
        blocks = -(-num_tokens // block_t)
        if blocks <= most:
            break
    programs = min(blocks, most)
    chunk_elements = 1 << ((_HELD - block_t * block_e) // 2).bit_length() - 1  # a power of two
    chunk = min(triton_next_power_of_2(blocks), max(1, chunk_elements // block_e))
    log_u = torch.empty(num_tokens, dtype=torch.float32, device=device)
    partials = torch.empty((2, 2, blocks, num_experts), dtype=torch.float32, device=device)  # [(max, sum), buffer]
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty_like(logits_TE)
    if valid_T is None:
        valid, real_target = counter, counter  # not read
    else:  # the torch version's column target, log(N / E) with N the real tokens, on the device
        valid = valid_T.contiguous().to(torch.int8)
        real_target = torch.log(valid_T.sum().clamp_min(1).to(torch.float32) / num_experts).reshape(1)
    _triton().sinkhorn[(programs,)](
        logits_TE, log_u, partials[0], partials[1], out, counter, num_tokens, num_experts, blocks,
        math.log(num_tokens / num_experts), valid, real_target,
        ITERATIONS=iterations, BLOCK_T=block_t, BLOCK_E=block_e, CHUNK=chunk,
        NUM_CHUNKS=triton_next_power_of_2(-(-blocks // chunk)),
        BLOCKS_PER_PROGRAM=triton_next_power_of_2(-(-blocks // programs)),
        MASKED=valid_T is not None, num_warps=8, launch_cooperative_grid=True,
    )  # fmt: skip
    return out


@_sinkhorn_op.register_fake
def _(logits_TE: torch.Tensor, iterations: int, valid_T: torch.Tensor | None, programs: int) -> torch.Tensor:
    return torch.empty(logits_TE.shape, dtype=logits_TE.dtype, device=logits_TE.device)


def triton_next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``triton.next_power_of_2``, without importing Triton)."""
    return 1 << max(0, (n - 1).bit_length())
