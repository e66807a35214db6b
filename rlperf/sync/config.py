"""How a weight sync moves the weights: bucket sizes and the transport, in one place.

The entry points (:func:`rlperf.sync.sync_weights`, the loop's router client) take a
:class:`SyncConfig`; the constants are its defaults.
"""
from __future__ import annotations

import dataclasses

SYNC_BUCKET_BYTES = 512 << 20
"""The bucket size of a weight sync and of :func:`rlperf.sync.flatten.flatten_buckets` by default
(512 MiB). Each bucket costs a handle open, a checksum and a round trip: Qwen3-4B-shaped bf16
(8.04 GB) over cuda_ipc to another process took 163 ms in 64 MiB buckets and 41 ms in 512 MiB ones
(H100, bench/BENCHMARKS.md "sync")."""

DISTRIBUTED_BUCKET_BYTES = 512 << 20
"""The bucket size of a broadcast to disaggregated engines (:class:`rlperf.sync.distributed.WeightBroadcaster`,
512 MiB): each bucket is one ``/update_weights_from_distributed`` request and one broadcast, and the
first bucket's pack and the last one's load are not overlapped with any transfer, so the best size
sits between per-request costs (small buckets) and that fill and drain (large ones). Measured with
``rlperf bench sync --distributed --bucket-mib 256,512,1024,2048`` (Qwen3-4B-shaped bf16, 8.04 GB, GPU 0
to an engine on GPU 1, H100, bench/BENCHMARKS.md "sync-distributed"): 256 MiB 0.79x, 512 MiB 0.82x,
1024 MiB 0.78x, 2048 MiB 0.73x of ``torch.distributed``'s broadcast of one buffer in the same run."""

INLINE_BUCKET_BYTES = 64 << 20
"""The bucket size of the ``inline`` transport, which carries the bytes base64-encoded in the HTTP
body: smaller requests."""

TRANSPORTS = ("inline", "shm", "cuda_ipc")
"""How a bucket's bytes reach another process (:mod:`rlperf.sync.transports`): base64 in the JSON
(any host), a shared-memory segment (same host, CPU), a CUDA IPC handle (same GPU host)."""


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """One weight sync's settings."""

    transport: str | None = None
    """``inline``, ``shm`` or ``cuda_ipc`` (:data:`TRANSPORTS`): each bucket travels as that payload and
    is received as a server receives it (description and checksum checked). None: no payload at
    all; each bucket's tensors are copied straight into the destination (same process and device)."""
    bucket_bytes: int | None = None
    """Bucket size limit in bytes; None: :data:`INLINE_BUCKET_BYTES` for ``inline``, else
    :data:`SYNC_BUCKET_BYTES`."""

    def __post_init__(self):
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {self.transport!r}")
        if self.bucket_bytes is None:
            object.__setattr__(self, "bucket_bytes",
                               INLINE_BUCKET_BYTES if self.transport == "inline" else SYNC_BUCKET_BYTES)
