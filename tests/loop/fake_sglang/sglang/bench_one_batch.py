"""``python -m sglang.bench_one_batch`` for tests: parses the flags rlperf's rollout bench passes (unknown
flags and attention backends exit 2, as SGLang's parser does; the backends are
``sglang.srt.server_args.ATTENTION_BACKEND_CHOICES``, where a loaded plugin adds ``rlperf``), loads the
model folder's tokenizer with transformers (as SGLang does before it measures), and appends one result
line per batch in SGLang 0.5.17's layout (``run_name``, ``batch_size``, ``input_len``, ``output_len``,
``prefill_latency`` and ``median_decode_latency`` in seconds, ...) to ``--result-filename``: a decode step
of ``(1 + batch / 64)`` ms and a prefill of ``(2 + batch / 8)`` ms, times 3 with
``--enable-deterministic-inference`` (flashinfer), 4 for its triton backend, 2 for rlperf's backend.
``$FAKE_SGLANG_FAIL``: ``exit`` -- print a CUDA error and exit 1; ``skip`` -- skip the largest batch, as
SGLang does one beyond its memory (printing its "skipping" line). ``$FAKE_SGLANG_FAIL_BACKEND``: exit 1 with
a CUDA out-of-memory traceback when ``--attention-backend`` is that one."""
import argparse
import json
import os
import sys

from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

p = argparse.ArgumentParser(prog="sglang.bench_one_batch")
p.add_argument("--model-path", required=True)
p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
p.add_argument("--batch-size", type=int, nargs="+", required=True)
p.add_argument("--input-len", type=int, nargs="+", required=True)
p.add_argument("--output-len", type=int, nargs="+", required=True)
p.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES)
p.add_argument("--page-size", type=int, default=1)
p.add_argument("--mem-fraction-static", type=float)
p.add_argument("--result-filename", required=True)
p.add_argument("--enable-deterministic-inference", action="store_true")
args = p.parse_args()

fail = os.environ.get("FAKE_SGLANG_FAIL")
if fail == "exit":
    print("RuntimeError: CUDA error: out of memory", file=sys.stderr)
    sys.exit(1)
if os.environ.get("FAKE_SGLANG_FAIL_BACKEND") == args.attention_backend:
    print("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
          "allocate 20.00 MiB.\n32.54 MiB is reserved by PyTorch but unallocated.", file=sys.stderr)
    sys.exit(1)
if args.attention_backend == "rlperf" and args.page_size != 128:
    print("rlperf.sglang_plugin.PluginError: --attention-backend rlperf needs --page-size 128", file=sys.stderr)
    sys.exit(1)
with open(os.path.join(args.model_path, "config.json")) as f:
    json.load(f)
from transformers import AutoTokenizer  # noqa: E402

AutoTokenizer.from_pretrained(args.model_path)
batches = args.batch_size
if fail == "skip":
    batches = sorted(args.batch_size)[:-1]
    print(f"skipping ({max(args.batch_size)}, {args.input_len[0]}, {args.output_len[0]}) due to max batch size limit")
scale = 1.0
if args.enable_deterministic_inference:
    scale = {"triton": 4.0, "rlperf": 2.0}.get(args.attention_backend, 3.0)
with open(args.result_filename, "a") as out:
    for b in batches:
        for il in args.input_len:
            for ol in args.output_len:
                step, prefill = scale * (1 + b / 64) / 1e3, scale * (2 + b / 8) / 1e3
                out.write(json.dumps({"run_name": "default", "batch_size": b, "input_len": il, "output_len": ol,
                                      "prefill_latency": prefill, "prefill_throughput": il * b / prefill,
                                      "median_decode_latency": step, "median_decode_throughput": b / step,
                                      "total_latency": prefill + ol * step}) + "\n")
