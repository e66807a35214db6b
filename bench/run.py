"""``rlperf bench``: run benchmark modules, print their tables, write JSON and BENCHMARKS.md sections.

Each benchmark module in this package exposes ``run(quick: bool) -> list[BenchRow]`` and
``summarize(rows) -> dict`` (the ratios that the targets are stated in). The kernel
microbenchmarks (:data:`MICROBENCHES`) also list their kernel-anchor pairs as data,
``cases(quick) -> list[BenchCase]``, which ``bench/test_microbench.py`` times under pytest-benchmark.
"""
from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from rlperf.flags import token_buckets

from .sglang_anchor import parse_sglang_variants

if TYPE_CHECKING:  # the harness imports torch: only a run needs it, not --help
    from .harness import BenchCase, BenchRow

BENCHES = {
    "matmul": "rlperf.bench.matmul",
    "attention": "rlperf.bench.attention",
    "layers": "rlperf.bench.layers",
    "flatten": "rlperf.bench.flatten",
    "sync": "rlperf.bench.sync",
    "logprob": "rlperf.bench.logprob",
    "rollout": "rlperf.bench.rollout",
    "loop": "rlperf.bench.loop",
    "moe": "rlperf.bench.moe",
}
DISTRIBUTED_SYNC = "sync-distributed"
"""``rlperf bench sync --distributed`` (:mod:`rlperf.bench.sync_distributed`): its results and markdown section."""
MICROBENCHES = ("matmul", "attention", "layers", "flatten", "logprob")
"""The benchmarks whose modules expose ``cases(quick)``: one kernel call against one anchor call per
case (sync, rollout and loop time whole processes, engine steps and RL steps, not a pair of calls)."""


def microbench_cases(quick: bool) -> list[BenchCase]:
    """Every case of every microbenchmark, in :data:`MICROBENCHES` order; builds no device inputs."""
    return [c for name in MICROBENCHES for c in importlib.import_module(BENCHES[name]).cases(quick)]


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "names", nargs="*", default=["all"], metavar="NAME",
        help=f"benchmarks to run: {', '.join(BENCHES)} or all (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (a smoke run, not for the table)")
    p.add_argument("--distributed", action="store_true",
                   help="with sync: the disaggregated sync, an NCCL broadcast from GPU 0 to rlperf serve engines on the "
                        "other GPUs (needs >= 2 GPUs; on CPU with --quick a gloo smoke run)")
    p.add_argument("--bucket-mib", default=None, metavar="LIST",
                   help="with sync --distributed: the bucket sizes to time, in MiB, comma-separated (e.g. "
                        "256,512,1024,2048); default: the loop's (rlperf.sync.DISTRIBUTED_BUCKET_BYTES), 512 and 2048")
    p.add_argument("--cuda-graph-buckets", default=None, metavar="auto|none|LIST", type=token_buckets,
                   help="with loop: train with rlperf train --cuda-graph-buckets auto, none or LIST (comma-separated "
                        "token counts, e.g. 1024,2048,4096): each packed micro-batch padded to its bucket and its "
                        "log-prob pass and train micro-step replayed from CUDA graphs; default: none (eager, the "
                        "anchor a graphed run is compared with; rlperf train's own default is auto)")
    p.add_argument("--sglang-variants", default=None, metavar="LIST", type=parse_sglang_variants,
                   help="with rollout (the full run): the SGLang anchors to run, comma-separated: "
                        "fast (SGLang's default mode, flashinfer attention), det-flashinfer "
                        "(--enable-deterministic-inference, flashinfer), det-triton (--enable-deterministic-inference "
                        "--attention-backend triton), plugin (SGLang with rlperf's plugin: --attention-backend rlperf "
                        "--page-size 128 --enable-deterministic-inference), all or none; they run in this order, one "
                        "SGLang process each (tens of seconds of device time each). The plugin's target rows need fast "
                        "and det-flashinfer in the same run. Example: rlperf bench rollout --sglang-variants "
                        "fast,det-flashinfer,plugin. Default: all")
    p.add_argument("--no-transformers-anchor", action="store_true",
                   help="with rollout (the full run): leave out the compiled-transformers rows (transformers compiles a "
                        "decoding graph per batch: minutes of device time), e.g. so the SGLang anchors fit one "
                        "10-minute device call: rlperf bench rollout --no-transformers-anchor --sglang-variants "
                        "fast,det-flashinfer,plugin. Default: the rows run")
    p.add_argument("--json", default="results/bench.json", metavar="PATH", help="result file (default: %(default)s)")
    p.add_argument(
        "--markdown", default=None, metavar="PATH",
        help="also rewrite this benchmark's section of a markdown file, e.g. bench/BENCHMARKS.md",
    )


UNAVAILABLE_CHARS = 160
"""A table cell's share of why an anchor did not run (the whole reason stays in the JSON's row)."""


def _one_line(text: str) -> str:
    """``text`` as one markdown table cell: whitespace runs as one space, ``|`` escaped, at most
    :data:`UNAVAILABLE_CHARS` characters."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= UNAVAILABLE_CHARS else text[:UNAVAILABLE_CHARS - 3].rstrip() + "..."


def _markdown_section(name: str, rows: list[BenchRow], info: dict, summary: dict) -> str:
    lines = [
        f"<!-- bench:{name} start -->",
        f"### {name}",
        "",
        f"Card **{info.get('card')}**, commit `{info.get('commit')}`, {info.get('date')}, "
        f"torch {info.get('torch')}, Triton {info.get('triton')}, CUDA {info.get('cuda')}. "
        f"Command: `{'RLPERF_PDL=0 ' if info.get('programmatic_launch_off') else ''}rlperf bench "
        f"{'sync --distributed' if name == DISTRIBUTED_SYNC else name} --markdown bench/BENCHMARKS.md`.",
        "",
        "| case | kernel | ms | anchor | anchor ms | ratio (anchor/kernel) | rate | anchor rate |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]

    def rate(ms: float, r: BenchRow) -> str:  # rows without a work measure have no rate
        value = r.rate(ms)
        return "-" if math.isnan(value) else f"{value:.1f} {r.unit}"

    for r in rows:
        anchor, kernel = r.anchor, r.kernel
        if r.extra.get("anchor_unavailable"):  # the row stays, saying why its anchor did not run
            anchor = f"{r.anchor} (did not run: {_one_line(r.extra['anchor_unavailable'])})"
        if r.extra.get("kernel_unavailable"):  # ... or why its measured side did not
            kernel = f"{r.kernel} (did not run: {_one_line(r.extra['kernel_unavailable'])})"
        lines.append(
            f"| {r.case} | {kernel} | {r.kernel_ms:.4f} | {anchor} | {r.anchor_ms:.4f} | {r.ratio:.3f} | "
            f"{rate(r.kernel_ms, r)} | {rate(r.anchor_ms, r)} |"
        )
    lines += ["", "Summary: " + ", ".join(f"{k} = {v:.3f}" if isinstance(v, float) else f"{k} = {v}" for k, v in summary.items()), ""]
    lines.append(f"<!-- bench:{name} end -->")
    return "\n".join(lines)


def update_markdown(path: Path, name: str, section: str) -> None:
    """Replace the ``name`` section of ``path`` (between its markers) or append it."""
    text = path.read_text() if path.exists() else "# rlperf benchmarks\n\n"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} start -->.*?<!-- bench:{re.escape(name)} end -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def run_benchmarks(args: argparse.Namespace) -> int:
    import torch

    from .harness import environment, format_table, write_json

    names = list(BENCHES) if "all" in args.names else args.names
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"rlperf bench: unknown benchmark(s) {unknown}; choose from {list(BENCHES)} or all", file=sys.stderr)
        return 2
    benches = BENCHES
    run_kwargs: dict = {}
    if getattr(args, "bucket_mib", None) is not None:
        if not getattr(args, "distributed", False):
            print("rlperf bench: --bucket-mib goes with sync --distributed", file=sys.stderr)
            return 2
        try:
            sizes = tuple(int(float(x) * 2**20) for x in args.bucket_mib.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            print(f"rlperf bench: --bucket-mib {args.bucket_mib}: expected positive sizes in MiB, comma-separated "
                  "(e.g. 256,512,1024,2048)", file=sys.stderr)
            return 2
        run_kwargs["bucket_sizes"] = sizes
    if getattr(args, "cuda_graph_buckets", None) is not None:
        if names != ["loop"]:
            print("rlperf bench: --cuda-graph-buckets goes with the loop benchmark alone: rlperf bench loop "
                  "--cuda-graph-buckets auto|none|LIST", file=sys.stderr)
            return 2
        run_kwargs["cuda_graph_buckets"] = args.cuda_graph_buckets
    if getattr(args, "sglang_variants", None) is not None:
        if names != ["rollout"]:
            print("rlperf bench: --sglang-variants goes with the rollout benchmark alone: rlperf bench rollout "
                  "--sglang-variants LIST", file=sys.stderr)
            return 2
        if args.quick:
            print("rlperf bench: --sglang-variants picks the SGLang anchors of the full rollout run; --quick runs none",
                  file=sys.stderr)
            return 2
        run_kwargs["sglang_variants"] = args.sglang_variants
    if getattr(args, "no_transformers_anchor", False):
        if names != ["rollout"] or args.quick:
            print("rlperf bench: --no-transformers-anchor goes with the full rollout run alone (--quick runs no "
                  "transformers rows): rlperf bench rollout --no-transformers-anchor", file=sys.stderr)
            return 2
        run_kwargs["transformers_anchor"] = False
    if getattr(args, "distributed", False):  # rlperf bench sync --distributed: its own module and markdown section
        if names != ["sync"]:
            print("rlperf bench: --distributed goes with the sync benchmark alone: rlperf bench sync --distributed",
                  file=sys.stderr)
            return 2
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 1 or (gpus == 0 and not args.quick):
            print(f"rlperf bench: sync --distributed needs at least 2 GPUs, {gpus} visible (without a GPU, --quick runs "
                  "a gloo smoke test)", file=sys.stderr)
            return 2
        names, benches = [DISTRIBUTED_SYNC], {DISTRIBUTED_SYNC: "rlperf.bench.sync_distributed"}
    elif not torch.cuda.is_available():
        print("rlperf bench: needs a CUDA GPU (CPU timings are not performance results)", file=sys.stderr)
        return 2
    info = environment()
    pdl = (" | kernels launched with PDL" if info["programmatic_launch"]
           else " | plain launches (RLPERF_PDL=0)" if info["programmatic_launch_off"] else "")
    print(f"# {info['card']} | commit {info['commit']} | torch {info['torch']} | triton {info['triton']} | {info['date']}{pdl}")
    all_rows: list[BenchRow] = []
    summaries: dict = {}
    for name in names:
        module = importlib.import_module(benches[name])
        rows = module.run(quick=args.quick, **run_kwargs)
        summary = module.summarize(rows)
        all_rows += rows
        summaries[name] = summary
        print(format_table(rows))
        print(f"{name} summary: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
        if args.markdown:
            update_markdown(Path(args.markdown), name, _markdown_section(name, rows, info, summary))
    json_path = Path(args.json)
    if len(names) == 1 and json_path.name == "bench.json":
        json_path = json_path.with_name(f"bench-{names[0]}.json")
    write_json(json_path, all_rows, info, summaries)
    print(f"results: {json_path}")
    return 0
