"""Flatten benchmark: a Qwen3-4B parameter set into 512 MiB buckets and back, against copy bandwidth.

Workload: the Qwen3-4B parameter shapes in bf16 (tied LM head, so no separate head):
embed 151936x2560; 36 layers x (q 4096x2560, k 1024x2560, v 1024x2560, o 2560x4096,
gate/up 9728x2560, down 2560x9728, input/post-attention norms 2560, q/k norms 128); final norm 2560.
That is 1 + 36 x 11 + 1 = 398 tensors (issue #3 says 397; its 8.04 GB matches these 398) and
8,044,936,192 bytes.

Rows (every rate counts bytes read + bytes written, 2 x 8.04 GB per pass; ratio = anchor ms /
kernel ms, so against the single copy it is the fraction of copy bandwidth reached):

* ``flatten_buckets`` (plan + allocate + one multi-tensor pack launch per bucket) vs one
  device-to-device copy of the same bytes (``dst.copy_(src)``, the ceiling) and vs ``torch.cat``
  of the tensors' flattened uint8 views per bucket (SGLang's FlattenedTensorBucket way);
* ``load_into`` (checks + one multi-tensor unpack launch per bucket into the parameters) vs the
  same single copy and vs ``unflatten`` + ``torch._foreach_copy_`` (torch's multi-tensor copy);
* the pack kernel alone at several chunk sizes (no planning or allocation), to separate kernel
  bandwidth from host overhead;
* ``bucket_checksum`` over every bucket vs ``torch.sum`` of the same buffers viewed as int64 (both
  read every byte once; these two rates count bytes read).

Timing: ``cuda_time`` with ``flush_l2=False`` (gigabytes of data; L2 is 50-60 MB). ``cases(quick)``
lists these kernel-anchor pairs for ``bench/test_microbench.py`` (pytest-benchmark).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from rlperf.sync import SYNC_BUCKET_BYTES

from .harness import BenchCase, BenchRow, Workload, call_names, cuda_time, time_calls

BENCH = "flatten"
BUCKET_BYTES = SYNC_BUCKET_BYTES  # the loop's weight-sync bucket size (512 MiB)
CHUNK_SWEEP = (4 * 1024, 8 * 1024, 16 * 1024, 32 * 1024, 64 * 1024)

# Qwen3-4B (config.json): hidden 2560, 36 layers, 32 query heads and 8 KV heads of dim 128,
# intermediate 9728, vocab 151936, tie_word_embeddings = true.
HIDDEN, LAYERS, HEAD_DIM, Q_HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 2560, 36, 128, 32, 8, 9728, 151936


def qwen3_4b_shapes(num_layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every Qwen3-4B parameter, in checkpoint order."""
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (Q_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, Q_HEADS * HEAD_DIM)),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return shapes


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
        raise AssertionError(f"flatten bench: {what} differs")


COPY = "d2d copy"  # the ceiling every path is held against
FLUSH_L2 = False  # every call moves gigabytes: L2 (50-60 MB) holds none of it anyway


def cases(quick: bool = False) -> list[BenchCase]:
    return _cases(qwen3_4b_shapes(4 if quick else LAYERS), torch.device("cuda"), BUCKET_BYTES)


def _cases(shapes, device: torch.device, bucket_bytes: int) -> list[BenchCase]:
    """Every row's kernel-anchor pair on one workload (``shapes`` in bf16, built by :func:`_build`)."""
    total = sum(2 * math.prod(s) for _, s in shapes)
    case = f"qwen3-4b {len(shapes)}x bf16 {total / 1e9:.2f} GB"
    setup = functools.partial(_setup, shapes, device, bucket_bytes)

    def pair(kernel, anchor, work=2 * total, **more):
        return BenchCase(BENCH, case, kernel, anchor, setup=setup, work=work, unit="GB/s", flush_l2=FLUSH_L2,
                         params={"tensors": len(shapes), "bytes": total, **more})

    out = [pair("flatten_buckets", COPY), pair("torch.cat", COPY), pair("flatten_buckets", "torch.cat"),
           pair("load_into", COPY), pair("foreach_copy_", COPY), pair("load_into", "foreach_copy_")]
    out += [pair(f"pack kernel {c >> 10}K", COPY, chunk_bytes=c) for c in CHUNK_SWEEP]
    out.append(pair("bucket_checksum", "int64 sum", work=total, note="reads only: rates count bytes read"))
    return out


@dataclasses.dataclass
class _Buckets:
    """The parameters, their buckets, and the copy ceiling's buffers of the same byte count."""

    params: dict[str, torch.Tensor]
    buckets: list
    src: torch.Tensor
    dst: torch.Tensor
    bucket_bytes: int

    def calls(self) -> dict:
        from rlperf import sync as B

        named, params, buckets = list(self.params.items()), self.params, self.buckets
        groups = [[params[m.name] for m in b.metadata] for b in buckets]
        packs = [([params[m.name] for m in b.metadata], b.buffer, [m.start_idx for m in b.metadata]) for b in buckets]

        def flatten_cat():  # SGLang's FlattenedTensorBucket way
            return [torch.cat([t.view(-1).view(torch.uint8) for t in g]) for g in groups]

        def load_all():
            for b in buckets:
                b.load_into(params)

        def load_foreach():
            for b in buckets:
                views = b.unflatten()
                torch._foreach_copy_([params[n] for n in views], list(views.values()))

        def pack_all(chunk):  # the pack kernel alone: sources and offsets prepared once
            for srcs, buf, offs in packs:
                torch.ops.rlperf.multi_tensor_pack(srcs, buf, offs, chunk)

        calls = {
            COPY: lambda: self.dst.copy_(self.src),
            "flatten_buckets": lambda: B.flatten_buckets(named, self.bucket_bytes),
            "torch.cat": flatten_cat,
            "load_into": load_all,
            "foreach_copy_": load_foreach,
            "bucket_checksum": lambda: [B.bucket_checksum(b.buffer) for b in buckets],
            "int64 sum": lambda: [b.buffer.view(torch.int64).sum() for b in buckets],
        }
        calls.update({f"pack kernel {c >> 10}K": functools.partial(pack_all, c) for c in CHUNK_SWEEP})
        return calls


def _build(shapes, device: torch.device, bucket_bytes: int) -> _Buckets:
    from rlperf import sync as B

    if device.type == "cuda" and not B.extension_available("cuda"):
        raise RuntimeError("flatten bench: rlperf._C has no CUDA kernels (build it with nvcc: pip install -e .)")
    gen = torch.Generator(device=device).manual_seed(0)
    params = {n: torch.randn(s, generator=gen, dtype=torch.bfloat16, device=device) for n, s in shapes}
    total = sum(t.numel() * t.element_size() for t in params.values())
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
    buckets = B.flatten_buckets(list(params.items()), bucket_bytes)
    return _Buckets(params, buckets, src, torch.empty_like(src), bucket_bytes)


def _setup(shapes, device: torch.device, bucket_bytes: int) -> Workload:
    return Workload(_build(shapes, device, bucket_bytes).calls())


def _check(data: _Buckets, calls: dict) -> None:
    """Every timed path moves the right bytes, on the measured data."""
    params, buckets = data.params, data.buckets
    for b in buckets:  # bucket views equal the parameters
        for n, v in b.unflatten().items():
            _assert_bits_equal(v, params[n], f"bucket view of {n}")
    # no padding, so torch.cat of the same tensors is comparable, and gives the same bytes
    assert all(m.start_idx % 16 == 0 and m.nbytes % 16 == 0 for b in buckets for m in b.metadata)
    for b, c in zip(buckets, calls["torch.cat"]()):
        _assert_bits_equal(b.buffer, c, "torch.cat bucket")
    # load_into: poison every parameter, load, compare with the bucket views
    for t in params.values():
        t.fill_(float("nan"))
    calls["load_into"]()
    for b in buckets:
        for n, v in b.unflatten().items():
            _assert_bits_equal(params[n], v, f"loaded {n}")
    assert all(b.nbytes % 8 == 0 for b in buckets)  # the int64 sum reads whole buckets


def run(quick: bool = False) -> list[BenchRow]:
    warmup, reps = (2, 5) if quick else (3, 20)
    timer = lambda fn: cuda_time(fn, warmup=warmup, reps=reps, flush_l2=FLUSH_L2)  # noqa: E731
    return measure(qwen3_4b_shapes(4 if quick else LAYERS), torch.device("cuda"), timer)


def measure(shapes, device: torch.device, timer, bucket_bytes: int = BUCKET_BYTES) -> list[BenchRow]:
    """Build the parameters, check every path's bytes, time each with ``timer(fn) -> Timing``."""
    data = _build(shapes, device, bucket_bytes)
    total = data.src.numel()
    print(f"flatten: {len(data.params)} tensors, {total:,} bytes ({total / 1e9:.2f} GB) bf16, "
          f"buckets of {bucket_bytes / 2**20:g} MiB")
    print(f"flatten: {len(data.buckets)} buckets, sizes (MiB) {[round(b.nbytes / 2**20, 1) for b in data.buckets]}")
    w = Workload(data.calls())
    _check(data, w.calls)
    group = _cases(shapes, device, bucket_bytes)
    times = time_calls(w, call_names(group), timer, BENCH)
    copy_repeat = timer(w.calls[COPY])  # the spread of the ceiling
    return [
        c.row(times[c.kernel].median_ms, times[c.anchor].median_ms, buckets=len(data.buckets),
              copy_ms_repeat=copy_repeat.median_ms, p20_ms=times[c.kernel].p20_ms, p80_ms=times[c.kernel].p80_ms)
        for c in group
    ]


def summarize(rows: list[BenchRow]) -> dict:
    def find(kernel, anchor):
        return next(r for r in rows if r.kernel == kernel and r.anchor == anchor)

    flat, cat = find("flatten_buckets", "d2d copy"), find("torch.cat", "d2d copy")
    load, foreach = find("load_into", "d2d copy"), find("foreach_copy_", "d2d copy")
    return {
        "copy_GBps": flat.rate(flat.anchor_ms),
        "flatten_GBps": flat.rate(flat.kernel_ms),
        "flatten_vs_copy": flat.ratio,
        "torch_cat_vs_copy": cat.ratio,
        "flatten_vs_torch_cat": find("flatten_buckets", "torch.cat").ratio,
        "load_GBps": load.rate(load.kernel_ms),
        "load_vs_copy": load.ratio,
        "foreach_copy_vs_copy": foreach.ratio,
        "load_vs_foreach_copy": find("load_into", "foreach_copy_").ratio,
        "checksum_GBps": find("bucket_checksum", "int64 sum").rate(find("bucket_checksum", "int64 sum").kernel_ms),
        "target_flatten_0.90": "met" if flat.ratio >= 0.90 else "missed",
        "target_load_0.90": "met" if load.ratio >= 0.90 else "missed",
    }
