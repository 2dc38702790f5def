"""Experts: the grouped expert MLPs a dispatcher feeds (``grouped``: SwiGLU on the Hugging Face
3-D layout; ``variants``: interleaved and biased GLUs; ``mlp``: the fused grouped MLP; ``segments``:
one GEMM per expert; ``grad_scale``: the gradient scale under autograd; ``lora``: LoRA factors
stacked by expert). Imports ``kernels`` and ``dispatch.base`` only.
"""

from lightning_ep.moe.experts.grouped import GroupedExperts, RoutedExperts
from lightning_ep.moe.experts.variants import InterleavedGLUExperts

__all__ = ["GroupedExperts", "InterleavedGLUExperts", "RoutedExperts"]
