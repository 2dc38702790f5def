"""Triton kernels with their torch references: the SwiGLU activation (``swiglu``), the Sinkhorn
normalisation (``sinkhorn``), the gradient of a weight cast (``cast``) and the grouped GEMM's weight
gradients in fp32 (``grouped_wgrad``); ``lazy_triton`` builds kernels on first use where Triton is
installed. Imports nothing else of ``lightning_ep``.
"""
