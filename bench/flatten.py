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

Timing: ``cuda_time`` with ``flush_l2=False`` (gigabytes of data; L2 is 50-60 MB).
"""
from __future__ import annotations

import torch

from rlperf.sync import SYNC_BUCKET_BYTES

from .harness import BenchRow, cuda_time

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


def run(quick: bool = False) -> list[BenchRow]:
    from rlperf import sync as B

    if not B.extension_available("cuda"):
        raise RuntimeError("flatten bench: rlperf._C has no CUDA kernels (build it with nvcc: pip install -e .)")
    warmup, reps = (2, 5) if quick else (3, 20)
    timer = lambda fn: cuda_time(fn, warmup=warmup, reps=reps, flush_l2=False)  # noqa: E731
    return measure(qwen3_4b_shapes(4 if quick else LAYERS), torch.device("cuda"), timer)


def measure(shapes, device: torch.device, timer, bucket_bytes: int = BUCKET_BYTES) -> list[BenchRow]:
    """Build the parameters, check every path's bytes, time each with ``timer(fn) -> Timing``."""
    from rlperf import sync as B

    gen = torch.Generator(device=device).manual_seed(0)
    params = {n: torch.randn(s, generator=gen, dtype=torch.bfloat16, device=device) for n, s in shapes}
    total = sum(t.numel() * t.element_size() for t in params.values())
    moved = 2 * total
    print(f"flatten: {len(params)} tensors, {total:,} bytes ({total / 1e9:.2f} GB) bf16, buckets of {bucket_bytes / 2**20:g} MiB")
    case = f"qwen3-4b {len(params)}x bf16 {total / 1e9:.2f} GB"
    named = list(params.items())

    # The ceiling: one device-to-device copy of the same number of bytes.
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy_fn = lambda: dst.copy_(src)  # noqa: E731
    t_copy = timer(copy_fn)

    # Correctness on the measured data: bucket views equal the parameters; torch.cat gives the same bytes.
    buckets = B.flatten_buckets(named, bucket_bytes)
    print(f"flatten: {len(buckets)} buckets, sizes (MiB) {[round(b.nbytes / 2**20, 1) for b in buckets]}")
    for b in buckets:
        for n, v in b.unflatten().items():
            _assert_bits_equal(v, params[n], f"bucket view of {n}")
    groups = [[params[m.name] for m in b.metadata] for b in buckets]
    assert all(m.start_idx % 16 == 0 and m.nbytes % 16 == 0 for b in buckets for m in b.metadata)  # no padding: cat is comparable

    def flatten_cat():
        return [torch.cat([t.view(-1).view(torch.uint8) for t in g]) for g in groups]

    for b, c in zip(buckets, flatten_cat()):
        _assert_bits_equal(b.buffer, c, "torch.cat bucket")

    t_flat = timer(lambda: B.flatten_buckets(named, bucket_bytes))
    t_cat = timer(flatten_cat)

    # load_into: poison every parameter, load, compare with the bucket views.
    for t in params.values():
        t.fill_(float("nan"))
    for b in buckets:
        b.load_into(params)
    for b in buckets:
        for n, v in b.unflatten().items():
            _assert_bits_equal(params[n], v, f"loaded {n}")

    def load_all():
        for b in buckets:
            b.load_into(params)

    def load_foreach():
        for b in buckets:
            views = b.unflatten()
            torch._foreach_copy_([params[n] for n in views], list(views.values()))

    t_load = timer(load_all)
    t_foreach = timer(load_foreach)

    # The pack kernel alone, per chunk size: sources and offsets prepared once.
    packs = [([params[m.name] for m in b.metadata], b.buffer, [m.start_idx for m in b.metadata]) for b in buckets]
    t_chunks = {}
    for chunk in CHUNK_SWEEP:
        def pack_all(chunk=chunk):
            for srcs, buf, offs in packs:
                torch.ops.rlperf.multi_tensor_pack(srcs, buf, offs, chunk)

        t_chunks[chunk] = timer(pack_all)
    t_checksum = timer(lambda: [B.bucket_checksum(b.buffer) for b in buckets])
    assert all(b.nbytes % 8 == 0 for b in buckets)
    t_sum = timer(lambda: [b.buffer.view(torch.int64).sum() for b in buckets])
    t_copy2 = timer(copy_fn)  # repeat: the spread of the ceiling

    copy_name = "d2d copy"
    extra = {"tensors": len(params), "bytes": total, "buckets": len(buckets), "copy_ms_repeat": t_copy2.median_ms}

    def row(kernel, t, anchor, t_anchor, work=moved, **more):
        return BenchRow(
            BENCH, case, kernel, t.median_ms, anchor, t_anchor.median_ms, work=work, unit="GB/s",
            extra={**extra, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, **more},
        )

    rows = [
        row("flatten_buckets", t_flat, copy_name, t_copy),
        row("torch.cat", t_cat, copy_name, t_copy),
        row("flatten_buckets", t_flat, "torch.cat", t_cat),
        row("load_into", t_load, copy_name, t_copy),
        row("foreach_copy_", t_foreach, copy_name, t_copy),
        row("load_into", t_load, "foreach_copy_", t_foreach),
    ]
    rows += [row(f"pack kernel {c >> 10}K", t_chunks[c], copy_name, t_copy, chunk_bytes=c) for c in CHUNK_SWEEP]
    rows.append(row("bucket_checksum", t_checksum, "int64 sum", t_sum, work=total, note="reads only: rates count bytes read"))
    return rows


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
