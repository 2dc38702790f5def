"""Triton kernels with their torch references: the SwiGLU activation (``swiglu``) and the Sinkhorn
normalisation (``sinkhorn``); ``lazy_triton`` builds kernels on first use where Triton is installed.
Imports nothing else of ``lightning_ep``.
"""
