"""The megatron trainer backend: megatron-core's ``GPTModel`` on rlperf's kernels.

* :mod:`.runtime` — megatron-core's process groups (tensor / pipeline / data parallel) and the CPU
  paths it needs under gloo (device queries and the model-parallel RNG tracker);
* :mod:`.layers` — the ``ModuleSpec`` submodules: rlperf's batch-invariant kernels in tensor-parallel
  layers whose reductions follow the fixed trees of ``rlperf.kernels.tree_reduce``;
* :mod:`.model` — a ``GPTModel`` from :class:`rlperf.model.ModelConfig`, with Hugging Face names in
  and out (loaded and exported bucket by bucket);
* :mod:`.trainer` — :class:`MegatronTrainer`, the methods :class:`rlperf.train.Trainer` offers the loop;
* :mod:`.backend` — ``--train-backend megatron`` as a registered :class:`rlperf.train.backend.TrainerBackend`
  (process groups, shards from rank 0's weights, the tree-mode engine copy).

megatron-core is imported only inside this package (``pip install -e ".[megatron]"``).
"""
