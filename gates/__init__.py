"""rlperf.gates — first-step gates (kl_zero, logprob_abs_diff, oom_headroom, sanity) run by `rlperf gate`.

The gates land with the trainer and the RL loop (issue #5); until then `rlperf gate` says so and exits 2.
"""
