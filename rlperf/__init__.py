"""rlperf — a performance lab for RL post-training of large language models.

The product, in import layers (each imports only its own layer and those below it;
docs/ARCHITECTURE.md draws them):

* ``rlperf.kernels`` — batch-invariant Triton kernels, their float64 torch references and the
  kernel policy (``rlperf._C``: the C++/CUDA bucket copies);
* ``rlperf.model`` — a Qwen3-style decoder on those kernels; ``rlperf.telemetry`` — memory
  readings, the phase meter, timeline and trainer traces;
* ``rlperf.rollout`` — the engine, the SGLang-compatible server and the router launcher;
  ``rlperf.train`` — losses, advantages, batching, the trainer (FSDP2 on several ranks);
  ``rlperf.sync`` — weight buckets, checksums and transports; ``rlperf.data`` — prompts, rewards;
* ``rlperf.loop`` — the RL loop: configuration, the seam to the engines, placement of ranks and engines;
* ``rlperf.gates`` — the first-step gates; ``rlperf.cli`` — the ``rlperf`` command (``rlperf --help``).

Tools on top, imported only by the CLI: ``rlperf.bench`` (benchmarks), ``rlperf.profiles``
(profiling rollout servers behind a router). ``kernels/``, ``gates/``, ``bench/`` and ``profiles/``
live at the top of the repository and import as these subpackages.
"""
__version__ = "0.1.0"
