"""rlperf.sync — weight sync between the trainer and the rollout servers.

``rlperf.sync.buckets`` packs named parameters into a few contiguous uint8 buckets (one
multi-tensor copy launch each, from the ``rlperf._C`` extension), describes them as JSON, and loads
them back into destination parameters with one launch per bucket.
"""
from .buckets import (
    ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    FlattenedBucket,
    FlattenedTensorMetadata,
    bucket_checksum,
    extension_available,
    flatten_buckets,
    plan_buckets,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "FlattenedBucket",
    "FlattenedTensorMetadata",
    "bucket_checksum",
    "extension_available",
    "flatten_buckets",
    "plan_buckets",
]
