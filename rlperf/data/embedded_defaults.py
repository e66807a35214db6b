"""The flag values of ``rlperf train`` with no ``--prompt-data`` (the embedded task, :mod:`rlperf.data.embedded`).

A module of its own, without torch, so the flag parsers can show these defaults in ``--help``.
"""

EMBEDDED_DEFAULTS = dict(
    rollout_batch_size=8, n_samples_per_prompt=16, global_batch_size=128, num_steps_per_rollout=1, num_rollout=80,
    rollout_max_response_len=2, rollout_temperature=1.0, lr=3e-3, rm_type="exact", model="tiny",
    use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
)
"""Flag values the embedded run uses where the command line gives none.

Why 16 samples per prompt and lr 3e-3: with 8 samples and lr 5e-3 the run's end reward depended on
the seed and on last-bit differences of the numerics (0.5-0.98 over seeds, CPU fp32 and GPU bf16):
GRPO's std-normalised advantages of a group with one right answer in 8 are large, and big steps made
some keys collapse onto a wrong letter, a group of identical answers that no longer has a gradient.
16 samples and a smaller step reached 0.92-0.99 over the seeds tried.

Why dynamic batching: the 128 samples of a step are short (a prompt and 2 response tokens), so one
packed micro-batch of up to 4096 tokens holds them all; one sample per micro-batch (slime's default,
what ``--prompt-data`` runs keep) made 128 forward/backward passes of a few dozen tokens each, which
on a GPU cost ~1.7 s of host-bound launches per step."""
