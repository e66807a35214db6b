"""rlperf — a performance lab for RL post-training of large language models.

Subpackages: ``rlperf.kernels`` (batch-invariant Triton kernels and torch references),
``rlperf.gates`` (first-step gates), ``rlperf.profiles`` (profile harness), ``rlperf.bench``
(microbenchmarks). The command line is ``rlperf`` (``rlperf --help``).
"""
__version__ = "0.1.0"
