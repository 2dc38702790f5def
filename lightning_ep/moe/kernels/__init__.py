"""Triton kernels with their torch references: the SwiGLU activation (``swiglu``), the Sinkhorn
normalisation (``sinkhorn``) and the gradient of a weight cast (``cast``); ``lazy_triton`` builds
kernels on first use where Triton is installed. Imports nothing else of ``lightning_ep``.
"""
