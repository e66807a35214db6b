"""rlperf.sync — weight sync between the trainer and the rollout engines, in one package.

* :mod:`~rlperf.sync.config` — :class:`SyncConfig` (transport, bucket size) and the bucket sizes
  :data:`SYNC_BUCKET_BYTES` / :data:`INLINE_BUCKET_BYTES` / :data:`DISTRIBUTED_BUCKET_BYTES`;
* :mod:`~rlperf.sync.flatten` — named parameters -> a few contiguous uint8 buckets (the planner, one
  multi-tensor copy launch per bucket; :func:`iter_buckets` one at a time) and :func:`weights_checksum`
  of a whole set of weights;
* :mod:`~rlperf.sync.buckets` — :class:`FlattenedBucket` and :class:`FlattenedTensorMetadata`
  (SGLang's fields and meanings), JSON descriptions, unflatten and load with one launch per bucket;
* :mod:`~rlperf.sync.transports` — a bucket as a JSON payload (inline bytes, shared memory, CUDA
  IPC), receiving and checking it, loading it; :func:`sync_weights`, the whole path in one process;
* :mod:`~rlperf.sync.distributed` — disaggregated engines: the weight-update process group
  (SGLang's ``/init_weights_update_group``) and :class:`WeightBroadcaster`, trainer rank 0's
  bucket-by-bucket broadcast to every engine (``/update_weights_from_distributed``);
* :mod:`~rlperf.sync.checksum` — the 64-bit bucket checksum (same bits on CPU, CUDA, fallback);
* :mod:`~rlperf.sync.dtypes` — the dtype allowlist of descriptions;
* :mod:`~rlperf.sync.extension` — the ``rlperf._C`` multi-tensor copies, or the pure-torch fallback.

The HTTP side of a sync through a router (pause the workers, post every bucket to
``/update_weights_from_tensor``, flush, continue) is the loop's client (:mod:`rlperf.loop.clients`);
the server side is ``rlperf serve`` (:mod:`rlperf.rollout.server`), which receives with this package.
"""
from .buckets import DESCRIPTION_FORMAT, FlattenedBucket, FlattenedTensorMetadata
from .checksum import bucket_checksum, mix64
from .config import DISTRIBUTED_BUCKET_BYTES, INLINE_BUCKET_BYTES, SYNC_BUCKET_BYTES, TRANSPORTS, SyncConfig
from .dtypes import DTYPES, dtype_from_name, dtype_name
from .extension import copy_backend, extension_available, use_torch_fallback
from .flatten import (ALIGNMENT, combine_checksums, flatten_buckets, iter_buckets, iter_buckets_with_last, plan_buckets,
                      weights_checksum)
from .transports import PayloadError, SyncStats, bucket_payload, load_bucket, receive_bucket, release, sync_weights

__all__ = [
    "ALIGNMENT", "DESCRIPTION_FORMAT", "DISTRIBUTED_BUCKET_BYTES", "DTYPES", "INLINE_BUCKET_BYTES",
    "SYNC_BUCKET_BYTES", "TRANSPORTS",
    "FlattenedBucket", "FlattenedTensorMetadata", "PayloadError", "SyncConfig", "SyncStats",
    "bucket_checksum", "bucket_payload", "copy_backend", "dtype_from_name", "dtype_name", "extension_available",
    "combine_checksums", "flatten_buckets", "iter_buckets", "iter_buckets_with_last", "load_bucket", "mix64",
    "plan_buckets", "receive_bucket", "release", "sync_weights",
    "use_torch_fallback", "weights_checksum",
]
