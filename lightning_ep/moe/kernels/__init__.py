"""Triton kernels with their torch references: ``swiglu``, ``sinkhorn``, ``cast`` (a weight cast's
gradient) and ``grouped_wgrad`` (fp32 weight gradients of the grouped GEMM); ``lazy_triton`` builds
them on first use where Triton is installed. Imports nothing else of ``lightning_ep``.
"""
