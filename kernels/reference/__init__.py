"""Torch references of every rlperf kernel: float64 math, obvious code, one module per op.

Tests compare the Triton kernels against these; on CPU without the Triton interpreter (or with
``backend="reference"``) the ops run them, result cast to the input dtype. The benchmarks do not:
their anchors are the stock torch ops (cuBLAS, SDPA, plain torch), timed on the GPU.
"""
