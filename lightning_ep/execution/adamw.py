"""The setup table's ``fused_adamw`` row: whether ``lightning_ep.optim.AdamW``'s kernels step the
optimizers Lightning set up, and the refusal of an ``Execution(fused_adamw=...)`` that contradicts them.

The strategy never changes the optimizer ``configure_optimizers`` returns, so the row reports, it
does not choose. The optimizers arrive by name (``execution.environment.optimizer_names``), so this
stays a pure function, tested for any device on CPU.
"""

from __future__ import annotations

from typing import Literal

#: How ``Environment.optimizers`` names an instance of ``lightning_ep.optim.AdamW`` (subclasses too),
#: the one optimizer with this library's AdamW kernels, and one of torch's own ``AdamW``.
KERNEL_ADAMW = "lightning_ep.optim.AdamW"
TORCH_ADAMW = "torch.optim.AdamW"
#: The row's reasons on CUDA with Triton: the kernels step; a ``torch.optim.AdamW`` steps instead.
KERNELS_REASON = "lightning_ep.optim.AdamW: torch's fused AdamW bits, a Triton kernel per large tensor"
TORCH_REASON = "torch.optim.AdamW steps with torch's kernels; lightning_ep.optim.AdamW steps the same bits faster"


def fused_adamw_row(
    option: bool | Literal["auto"], *, device_type: str, triton: bool, optimizers: tuple[str, ...] | None
) -> tuple[bool, str | None]:
    """Whether ``lightning_ep.optim.AdamW``'s kernels step one of ``optimizers`` on ``device_type``, and
    the row's reason (``None``: no row yet); ``ValueError`` with the fix for an ``option`` forced
    against the device or the optimizers."""
    fast = device_type == "cuda" and triton
    no_kernels = "CPU" if device_type != "cuda" else "no Triton"
    if option is True and not fast:
        raise ValueError(f"Execution(fused_adamw=True) needs CUDA with Triton ({no_kernels} here); use 'auto'.")
    if optimizers is None:
        return False, None
    ours, theirs = KERNEL_ADAMW in optimizers, TORCH_ADAMW in optimizers
    returned = ", ".join(optimizers) or "no optimizer"
    if option is True and (theirs or not ours):
        raise ValueError(
            f"Execution(fused_adamw=True) needs lightning_ep.optim.AdamW, but configure_optimizers returned "
            f"{returned}; construct lightning_ep.optim.AdamW(...) in place of torch.optim.AdamW (the same arguments "
            "and bits), or use fused_adamw='auto'."
        )
    if option is False and fast and ours:
        raise ValueError(
            "Execution(fused_adamw=False), but configure_optimizers returned lightning_ep.optim.AdamW, which steps "
            "with its kernels on CUDA; return torch.optim.AdamW(fused=True) for torch's kernels (the same bits), or "
            "use fused_adamw='auto'."
        )
    if fast and ours:
        reason = KERNELS_REASON
        if theirs:
            reason += "; torch.optim.AdamW: torch's kernels"
        return True, "forced; " + reason if option is True else reason
    if option is False:
        return False, "forced"
    if not fast:
        return False, f"auto: off on {no_kernels}"
    if theirs:
        return False, TORCH_REASON
    return False, f"{returned} steps with its own kernels (no AdamW)"
