"""Rollout tests run many tiny ops: one intra-op thread each is ~100x faster than threads fighting
over the shared CPU cores (server subprocesses get OMP_NUM_THREADS=1 for the same reason)."""
import torch

torch.set_num_threads(1)
