"""Weight-sync benchmark (issue #5): one full sync of Qwen3-4B-shaped weights on one GPU.

Workload: the Qwen3-4B parameter list of :func:`rlperf.bench.flatten.qwen3_4b_shapes` in bf16
(398 tensors, 8,044,936,192 bytes; ``--quick``: 4 layers, 46 tensors, 1.59 GB), synchronized into
a second, separate set of parameters of the same shapes (the rollout engine's copy). Bucket sizes:
the loop's (:data:`rlperf.sync.SYNC_BUCKET_BYTES`, 512 MiB: 16 buckets) and 64 MiB (145), which
shows what each extra bucket costs.

Rows (``work`` = bytes of parameters synchronized, so the rate is parameter GB per second of sync;
anchor = one device-to-device copy of the same number of bytes, ``dst.copy_(src)`` on uint8, timed
in the same run; ``ratio = anchor_ms / kernel_ms`` = the fraction of one plain copy's speed the
sync reaches; a sync moves at least 2x the copy's bytes, flatten then load, so <= ~0.5 is expected):

* ``sync in-process (B MiB buckets)``: what ``EngineClient.load_weights`` (``--engine-weights buckets``) does on one GPU, through
  the same entry point, :func:`rlperf.sync.sync_weights` (no transport): ``flatten_buckets(trainer
  params, B)``, then ``FlattenedBucket.load_into`` the engine's parameters, one bucket at a time
  (:func:`sync_in_process`).
* ``sync cuda_ipc (B MiB buckets)``: the colocated ``rlperf serve`` path: trainer and rollout
  server are separate processes on one GPU. One spawned child (:class:`SyncChild`) owns the
  destination parameters. Per sync the parent flattens, sends each bucket's
  ``bucket_payload(b, "cuda_ipc")`` (JSON: description with checksum + IPC handle) over a pipe;
  the child ``receive_bucket`` (opens the handle, verifies the checksum), loads the bucket into its
  parameters, synchronizes its device and acks; the parent drops the bucket after the ack. One
  request answered before the next, as ``push_weights`` does over HTTP.
* ``sync cuda_ipc, one ack (B MiB buckets)``: the same, but the parent sends every bucket and the
  child acks once per sync (no per-bucket round trip): the cost of the protocol's round trips is
  the difference between the two rows.

Timing (:func:`wall_time`): wall clock with the device synchronized at both ends (the child's work
happens in another process, so CUDA events in the parent cannot see it), median of ``reps`` after
``warmup`` calls. The first sync into the freshly started child is reported separately as
``cold_ms`` in ``extra`` (and every configuration's first, untimed sync as ``first_sync_ms``). Warm
syncs open every bucket's IPC handle too: the child drops each bucket after loading it, as a
server does, and torch closes a handle when its last storage dies; so cold - warm is the one-time
cost (the child's first IPC mappings, kernel loading and allocator growth), not the handle opens.
Correctness before timing: the destination is poisoned (every byte 0xFF), one sync runs, and the
destination must equal the source bit for bit (in-process: ``torch.equal`` per tensor; child:
``weights_checksum`` of its parameters equals the parent's).

Target (issue #5): a whole sync <= 50 ms for the 8 GB (summary ``target_50ms_*``, loop bucket size).
"""
from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from typing import Callable

import torch

from .harness import BenchRow, Timing

BENCH = "sync"
BUDGET_MS = 50.0
EXTRA_BUCKET_BYTES = 64 * 1024 * 1024
READY_TIMEOUT_S = 600.0  # spawn + import torch + CUDA context + allocating 8 GB in the child
REPLY_TIMEOUT_S = 300.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: the child must pick the parent's GPU explicitly."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def wall_time(fn: Callable[[], object], *, warmup: int, reps: int, device: torch.device) -> Timing:
    """Milliseconds per call of ``fn``: wall clock, ``device`` synchronized before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _synchronize(device)
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(median_ms=statistics.median(times), p20_ms=q[0], p80_ms=q[3], reps=reps)


def poison_(params: dict[str, torch.Tensor]) -> None:
    """Set every byte of every tensor to 0xFF (NaN for floats), so an unwritten byte shows."""
    for t in params.values():
        t.detach().reshape(-1).view(torch.uint8).fill_(0xFF)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included)."""
    return (
        a.shape == b.shape and a.dtype == b.dtype
        and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
    )


# ---------------------------------------------------------------------------------------------
# The two sync paths (no timing here)


def sync_in_process(named_tensors, dst_params: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    """``EngineClient.load_weights`` (buckets) on one GPU (:func:`rlperf.sync.sync_weights`, no transport):
    flatten into buckets, load each into ``dst_params``. Returns the number of buckets.
    """
    from rlperf.sync import SyncConfig, sync_weights

    return sync_weights(named_tensors, dst_params, config=SyncConfig(bucket_bytes=bucket_bytes)).buckets


def _child_main(conn, specs: list[tuple[str, list[int], str]], device: str) -> None:
    """The rollout-server side: own parameters, load buckets from payloads, answer on ``conn``.

    Messages in: ``("bucket", payload_json, ack)``, ``("end",)`` (ack the buckets since the last
    end), ``("poison",)``, ``("checksum",)``, ``("close",)``. Out: ``("ready", pid)``,
    ``("ack", n)``, ``("checksum", hex)``, ``("error", traceback text)``. Exits on ``close``, when the
    parent closes the pipe (EOF), or after reporting an error.
    """
    try:
        from rlperf.sync import dtype_from_name, receive_bucket, weights_checksum

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        params = {name: torch.empty(tuple(shape), dtype=dtype_from_name(dtype), device=dev) for name, shape, dtype in specs}
        poison_(params)
        _synchronize(dev)
        conn.send(("ready", os.getpid()))
        loaded = 0
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            kind = msg[0]
            if kind == "bucket":
                bucket = receive_bucket(msg[1], dev)  # checksum verified against the description
                bucket.load_into(params)
                del bucket  # drop the opened IPC memory before the sender may reuse it
                loaded += 1
                if msg[2]:
                    _synchronize(dev)
                    conn.send(("ack", loaded))
                    loaded = 0
            elif kind == "end":
                _synchronize(dev)
                conn.send(("ack", loaded))
                loaded = 0
            elif kind == "poison":
                poison_(params)
                _synchronize(dev)
                conn.send(("ack", 0))
            elif kind == "checksum":
                conn.send(("checksum", weights_checksum(params)))
            elif kind == "close":
                return
            else:
                raise ValueError(f"sync child: unknown message {kind!r}")
    except BaseException:  # noqa: BLE001  (everything goes back to the parent as text)
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        conn.close()


class SyncChildError(RuntimeError):
    """The sync child failed (its traceback is in the message), died, or did not answer in time."""


class SyncChild:
    """A spawned process standing for a colocated rollout server (see the module docstring).

    Parameters
    ----------
    specs : list of (name, shape, dtype name)
        The destination parameters the child allocates (poisoned) on ``device``.
    device : str or torch.device
        Where the child's parameters live ("cuda:0" for the cuda_ipc transport, "cpu" for shm).
    transport : "cuda_ipc" | "shm" | "inline"
        How :func:`rlperf.sync.bucket_payload` ships each bucket.

    Use as a context manager (or call :meth:`close`): the child is always joined, or terminated.
    """

    def __init__(self, specs, device, transport: str = "cuda_ipc", ready_timeout: float = READY_TIMEOUT_S):
        import torch.multiprocessing as mp

        self.device = _indexed(torch.device(device))
        self.transport = transport
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_child_main, args=(child_conn, [tuple(s) for s in specs], str(self.device)),
                                   daemon=True, name="rlperf-sync-child")
        self.process.start()
        child_conn.close()  # the child holds its end; EOF reaches us when it exits
        try:
            self._recv("ready", ready_timeout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def specs_of(named_tensors) -> list[tuple[str, list[int], str]]:
        from rlperf.sync import dtype_name

        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        return [(n, list(t.shape), dtype_name(t.dtype)) for n, t in items]

    # -- plumbing

    def _fail(self, why: str) -> None:
        pid, self_alive = self.process.pid, self.process.is_alive()
        self.close()
        state = "still running (terminated)" if self_alive else f"exit code {self.process.exitcode}"
        raise SyncChildError(f"sync child (pid {pid}, {state}): {why}")

    def _recv(self, expected: str, timeout: float = REPLY_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._conn.poll(0.5):
                    msg = self._conn.recv()
                    break
            except (EOFError, OSError):
                self._fail(f"the pipe closed while waiting for {expected!r}")
            if not self.process.is_alive() and not self._conn.poll(0):
                self._fail(f"exited while the parent waited for {expected!r}")
            if time.monotonic() > deadline:
                self._fail(f"no {expected!r} after {timeout:g} s")
        if msg[0] == "error":
            self._fail("failed:\n" + msg[1])
        if msg[0] != expected:
            self._fail(f"answered {msg[0]!r}, expected {expected!r}")
        return msg[1]

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            # the child stopped reading: it died or reported an error; its message may be waiting
            self._recv("error", timeout=10.0)

    # -- requests

    def sync(self, named_tensors, bucket_bytes: int, *, ack_each_bucket: bool = True) -> int:
        """Flatten ``named_tensors`` into buckets and load them into the child; returns the bucket count.

        With ``ack_each_bucket`` every bucket waits for the child's ack before the next is sent
        (``push_weights``' protocol) and is released after it; otherwise all are sent, the child acks
        once, and all are released then. Returns when the child's device has finished loading.
        """
        from rlperf.sync import bucket_payload, flatten_buckets, release

        buckets = flatten_buckets(named_tensors, bucket_bytes)
        pending = []  # handles that must outlive the child's read of their bucket
        try:
            for b in buckets:
                payload, handle = bucket_payload(b, self.transport)
                pending.append(handle)
                self._send(("bucket", json.dumps(payload), ack_each_bucket))
                if ack_each_bucket:
                    self._recv("ack")
                    release(pending.pop())
            if not ack_each_bucket:
                self._send(("end",))
                got = self._recv("ack")
                if got != len(buckets):
                    self._fail(f"acked {got} buckets, {len(buckets)} were sent")
        finally:
            for h in pending:
                release(h)
        return len(buckets)

    def poison(self) -> None:
        """Set every byte of the child's parameters to 0xFF."""
        self._send(("poison",))
        self._recv("ack")

    def checksum(self) -> str:
        """:func:`rlperf.sync.weights_checksum` of the child's parameters."""
        self._send(("checksum",))
        return self._recv("checksum")

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to exit, close the pipe, join; terminate (then kill) it if it does not exit."""
        if self.process.is_alive():
            try:
                self._conn.send(("close",))
            except (OSError, ValueError):
                pass
        self._conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def __enter__(self) -> "SyncChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The benchmark


def run(quick: bool = False) -> list[BenchRow]:
    from .flatten import LAYERS, qwen3_4b_shapes

    if not torch.cuda.is_available():
        raise RuntimeError("sync bench: needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    warmup, reps = (1, 5) if quick else (3, 20)
    timer = lambda fn: wall_time(fn, warmup=warmup, reps=reps, device=device)  # noqa: E731
    return measure(qwen3_4b_shapes(4 if quick else LAYERS), device, timer, transport="cuda_ipc")


def measure(shapes, device: torch.device, timer, *, transport: str = "cuda_ipc",
            bucket_sizes: tuple[int, ...] | None = None) -> list[BenchRow]:
    """Build the parameters, check every path's bits, time each with ``timer(fn) -> Timing``.

    ``shapes``: (name, shape) pairs (bf16 parameters). ``bucket_sizes``: default the loop's
    ``SYNC_BUCKET_BYTES`` then :data:`EXTRA_BUCKET_BYTES`. ``transport``: of the cross-process rows
    ("cuda_ipc" on a GPU; "shm" lets the whole measurement run on CPU in the tests).
    """
    from rlperf.sync import SYNC_BUCKET_BYTES, copy_backend, weights_checksum

    device = _indexed(torch.device(device))
    if bucket_sizes is None:
        bucket_sizes = tuple(dict.fromkeys((SYNC_BUCKET_BYTES, EXTRA_BUCKET_BYTES)))
    gen = torch.Generator(device=device).manual_seed(0)
    params = {n: torch.randn(s, generator=gen, dtype=torch.bfloat16, device=device) for n, s in shapes}
    named = list(params.items())
    total = sum(t.numel() * t.element_size() for t in params.values())
    backend = copy_backend(device)
    case = f"qwen3-4b {len(params)}x bf16 {total / 1e9:.2f} GB" + ("" if backend == "extension" else " (torch fallback)")
    print(f"sync: {len(params)} tensors, {total:,} bytes ({total / 1e9:.2f} GB) bf16 on {device}, "
          f"buckets of {[b / 2**20 for b in bucket_sizes]} MiB, flatten backend {backend}, transport {transport}", flush=True)
    if backend != "extension":
        print("sync: WARNING rlperf._C has no kernels for this device: timing the pure-torch fallback", flush=True)

    # Anchor: one device-to-device copy of the same number of bytes.
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    t_copy = timer(lambda: dst.copy_(src))
    src = dst = None  # the anchor's buffers go (the timed lambda reads these names)
    print(f"sync: d2d copy {t_copy.median_ms:.3f} ms", flush=True)

    results = []  # (kernel, Timing, extra)

    # 1. In-process: a second, separate set of parameters (the engine's copy).
    engine = {n: torch.empty_like(t) for n, t in params.items()}
    for bucket_bytes in bucket_sizes:
        mib = bucket_bytes / 2**20
        poison_(engine)
        n_buckets = sync_in_process(named, engine, bucket_bytes)
        _synchronize(device)
        bad = [n for n, t in params.items() if not bits_equal(engine[n], t)]
        if bad:
            raise AssertionError(f"sync bench: in-process sync left {len(bad)} tensors different, first {bad[0]}")
        t = timer(lambda bb=bucket_bytes: sync_in_process(named, engine, bb))
        print(f"sync: in-process {mib:g} MiB buckets ({n_buckets}): {t.median_ms:.3f} ms (bits checked)", flush=True)
        results.append((f"sync in-process ({mib:g} MiB buckets)", t,
                        {"path": "in-process", "bucket_bytes": bucket_bytes, "buckets": n_buckets}))
    engine = None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 2. Cross-process: one child process owns the destination parameters.
    expected = weights_checksum(named)
    print(f"sync: starting the child process ({transport}) ...", flush=True)
    t0 = time.perf_counter()
    with SyncChild(SyncChild.specs_of(named), device, transport) as child:
        print(f"sync: child pid {child.process.pid} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        cold_ms = None
        for bucket_bytes in bucket_sizes:
            mib = bucket_bytes / 2**20
            for ack_each in (True, False):
                child.poison()
                if child.checksum() == expected:
                    raise AssertionError("sync bench: the poisoned child already has the parent's checksum")
                _synchronize(device)
                t0 = time.perf_counter()
                n_buckets = child.sync(named, bucket_bytes, ack_each_bucket=ack_each)
                _synchronize(device)
                first_ms = (time.perf_counter() - t0) * 1e3
                got = child.checksum()
                if got != expected:
                    raise AssertionError(f"sync bench: child checksum {got} != parent {expected} after a {transport} sync")
                extra = {"path": "cross-process", "transport": transport, "bucket_bytes": bucket_bytes,
                         "buckets": n_buckets, "ack": "bucket" if ack_each else "sync", "first_sync_ms": first_ms}
                if cold_ms is None:
                    cold_ms = first_ms
                    extra["cold_ms"] = cold_ms
                    print(f"sync: cold (first) {transport} sync {cold_ms:.3f} ms", flush=True)
                t = timer(lambda bb=bucket_bytes, a=ack_each: child.sync(named, bb, ack_each_bucket=a))
                label = f"sync {transport}" + ("" if ack_each else ", one ack") + f" ({mib:g} MiB buckets)"
                print(f"sync: {label[5:]} ({n_buckets} buckets): {t.median_ms:.3f} ms (checksum checked)", flush=True)
                results.append((label, t, extra))
        print("sync: stopping the child", flush=True)

    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    t_copy2 = timer(lambda: dst.copy_(src))  # repeat: the spread of the anchor
    src = dst = None  # the anchor's buffers go (the timed lambda reads these names)

    common = {"tensors": len(params), "bytes": total, "flatten_backend": backend, "copy_ms_repeat": t_copy2.median_ms,
              "default_bucket_bytes": bucket_sizes[0]}
    copy_name = "d2d copy"
    rows = [
        BenchRow(BENCH, case, kernel, t.median_ms, copy_name, t_copy.median_ms, work=total, unit="GB/s",
                 extra={**common, **extra, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, "copy_p20_ms": t_copy.p20_ms,
                        "copy_p80_ms": t_copy.p80_ms})
        for kernel, t, extra in results
    ]
    return rows


def summarize(rows: list[BenchRow]) -> dict:
    """Per path at the loop's bucket size: ms, GB/s, ratio to the copy and the 50 ms target; the rest by bucket size."""
    first = rows[0]
    default = first.extra["default_bucket_bytes"]
    out = {"copy_ms": first.anchor_ms, "copy_GBps": first.rate(first.anchor_ms)}
    targets = {}
    for r in rows:
        path = r.extra.get("path")
        key = "in_process" if path == "in-process" else r.extra["transport"] + ("" if r.extra["ack"] == "bucket" else "_one_ack")
        if r.extra["bucket_bytes"] != default:
            key += f"_{r.extra['bucket_bytes'] / 2**20:g}MiB"
        out[f"{key}_ms"] = r.kernel_ms
        out[f"{key}_GBps"] = r.rate(r.kernel_ms)
        out[f"{key}_vs_copy"] = r.ratio
        if "cold_ms" in r.extra:
            out[f"{key}_cold_ms"] = r.extra["cold_ms"]
        if r.extra["bucket_bytes"] == default and (path == "in-process" or r.extra["ack"] == "bucket"):
            targets[f"target_50ms_{key}"] = "met" if r.kernel_ms <= BUDGET_MS else "missed"
    out.update(targets)
    return out
