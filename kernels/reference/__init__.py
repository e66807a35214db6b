"""Torch references of every rlperf kernel: float64 math, obvious code, one module per op.

Tests compare the Triton kernels against these; benchmarks import them as the naive baseline; on
CPU without the Triton interpreter the op layer runs them (result cast to the input dtype).
"""
