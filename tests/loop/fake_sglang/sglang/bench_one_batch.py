"""``python -m sglang.bench_one_batch`` for tests: parses the flags rlperf's rollout bench passes (unknown
flags exit 2, as SGLang's parser does), loads the model folder's tokenizer with transformers (as SGLang
does before it measures), and appends one result line per batch in SGLang 0.5.17's layout
(``run_name``, ``batch_size``, ``input_len``, ``output_len``, ``median_decode_latency`` in seconds, ...) to
``--result-filename``: a decode step of ``(1 + batch / 64)`` ms, 3x that with
``--enable-deterministic-inference``. ``$FAKE_SGLANG_FAIL``: ``exit`` -- print a CUDA error and exit 1;
``skip`` -- skip the largest batch, as SGLang does one beyond its memory."""
import argparse
import json
import os
import sys

p = argparse.ArgumentParser(prog="sglang.bench_one_batch")
p.add_argument("--model-path", required=True)
p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
p.add_argument("--batch-size", type=int, nargs="+", required=True)
p.add_argument("--input-len", type=int, nargs="+", required=True)
p.add_argument("--output-len", type=int, nargs="+", required=True)
p.add_argument("--attention-backend", choices=["flashinfer", "triton", "fa3"])
p.add_argument("--result-filename", required=True)
p.add_argument("--enable-deterministic-inference", action="store_true")
args = p.parse_args()

fail = os.environ.get("FAKE_SGLANG_FAIL")
if fail == "exit":
    print("RuntimeError: CUDA error: out of memory", file=sys.stderr)
    sys.exit(1)
with open(os.path.join(args.model_path, "config.json")) as f:
    json.load(f)
from transformers import AutoTokenizer  # noqa: E402

AutoTokenizer.from_pretrained(args.model_path)
batches = sorted(args.batch_size)[:-1] if fail == "skip" else args.batch_size
scale = 3.0 if args.enable_deterministic_inference else 1.0
with open(args.result_filename, "a") as out:
    for b in batches:
        for il in args.input_len:
            for ol in args.output_len:
                step = scale * (1 + b / 64) / 1e3
                out.write(json.dumps({"run_name": "default", "batch_size": b, "input_len": il, "output_len": ol,
                                      "prefill_latency": 0.01, "median_decode_latency": step,
                                      "median_decode_throughput": b / step, "total_latency": 0.01 + ol * step}) + "\n")
