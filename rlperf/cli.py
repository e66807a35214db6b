"""The ``rlperf`` command: one entry point, one subcommand per job.

Exit codes follow one rule everywhere: 0 success, 1 the job ran and found a failure (a gate, a
test), 2 bad usage.
"""
from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

def _bench(args: argparse.Namespace) -> int:
    from rlperf.bench.run import run_benchmarks

    return run_benchmarks(args)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlperf.model.config import PRESETS, read_hf_config
    from rlperf.rollout.args import server_args_from

    try:
        server_args = server_args_from(args)
    except ValueError as exc:  # an --api-key-file that cannot be read
        print(f"rlperf serve: {exc}", file=sys.stderr)
        return 2
    if server_args.attention_backend == "flashinfer":
        from rlperf.rollout.flashinfer_attention import FlashInferUnavailable, check_serve_flags

        try:
            check_serve_flags(server_args.mode, server_args.device)
        except (FlashInferUnavailable, ValueError) as exc:
            print(f"rlperf serve: --attention-backend flashinfer: {exc}", file=sys.stderr)
            return 2
    if server_args.model_path not in PRESETS:
        # a checkpoint's config.json is read before any server starts (with --router N too): a missing
        # directory or config.json, or a model rlperf does not implement (scaled RoPE, ...), is bad usage
        try:
            if not Path(server_args.model_path).is_dir():
                raise ValueError(f"neither a preset ({sorted(PRESETS)}) nor a directory")
            read_hf_config(server_args.model_path)
        except (OSError, ValueError) as exc:
            print(f"rlperf serve: --model-path {server_args.model_path}: {exc}", file=sys.stderr)
            return 2
    if args.router:
        from rlperf.rollout.router import serve_cluster

        return serve_cluster(server_args, args.router, args.router_port, args.router_policy)
    from rlperf.rollout.server import serve

    return serve(server_args)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (:func:`_sigterm_raises`) so that the run's ``finally`` blocks run
    (engines and ranks stopped, the timeline written, locks released) and the command ends with one line.
    Not an ``Exception``: no handler of a run's own errors takes it for one."""


STOP_AGAIN_AFTER_S = 0.01
"""Seconds before a stop that Python swallowed is raised again (:func:`_sigterm_raises`): the hook that
saw it has returned by then."""


def _stop_again(signum: int) -> None:
    """From a helper thread: trip ``signum``'s handler in the main thread again, where it runs at the next
    bytecode. ``interrupt_main`` raises no OS signal, so a handler reset to the default in the meantime
    (the run over) is left alone instead of killing the process."""
    time.sleep(STOP_AGAIN_AFTER_S)
    _thread.interrupt_main(signum)


@contextlib.contextmanager
def _sigterm_raises():
    """While the block runs, SIGTERM raises :class:`Terminated`; a second SIGTERM kills at once (the
    default action), should the cleanup itself hang.

    A stop (:class:`Terminated`, ``KeyboardInterrupt``) raised where Python swallows exceptions, in a
    ``__del__`` the garbage collector runs or a weakref callback, would be printed as "Exception ignored"
    and lost, the run going on. ``sys.unraisablehook`` takes it instead: it prints nothing, sets the
    SIGTERM handler again and has a helper thread trip the signal (:func:`_stop_again`), so the stop is
    raised at the next bytecode outside the finalizer and the run ends as a stopped run does."""
    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    def swallowed(unraisable):
        signum = (signal.SIGTERM if isinstance(unraisable.exc_value, Terminated)
                  else signal.SIGINT if isinstance(unraisable.exc_value, KeyboardInterrupt) else None)
        if signum is None:
            return previous_hook(unraisable)
        while True:
            try:
                if signum == signal.SIGTERM:
                    signal.signal(signal.SIGTERM, terminated)
                threading.Thread(target=_stop_again, args=(signum,), name="rlperf-stop-again", daemon=True).start()
                return None
            except (Terminated, KeyboardInterrupt):  # the trip already landed in this hook: trip it once more
                continue

    try:
        previous = signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # not the main thread (main() called from a thread): SIGTERM keeps its handler
        yield
        return
    previous_hook, sys.unraisablehook = sys.unraisablehook, swallowed
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)


def _new_dirs(*paths) -> list[Path]:
    """The directories among ``paths`` that do not exist yet: the ones this command creates."""
    return [Path(p) for p in paths if p and not Path(p).exists()]


def _remove_if_empty(dirs: list[Path]) -> None:
    """A command that ends having written nothing leaves no empty directory behind (rmdir removes only
    an empty one)."""
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


def _stopped(command: str, exc: BaseException, ns: argparse.Namespace, resume: bool) -> int:
    """The one line of a command stopped by SIGTERM or SIGINT: what it left under ``--output-dir`` (after
    :func:`_remove_if_empty`) and, for ``rlperf train`` (``resume``), how to go on; the shell's exit code
    of that signal (143, 130)."""
    from rlperf.loop import METRICS_FILE

    name, code = ("SIGTERM", 143) if isinstance(exc, Terminated) else ("SIGINT", 130)
    out = Path(getattr(ns, "output_dir", None) or ".")
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not files:
        left = "it wrote nothing" + ("" if out.is_dir() else f" ({out} removed)")
    else:
        metrics = out / METRICS_FILE
        rollouts = sum(1 for line in metrics.open("rb") if line.strip()) if metrics.is_file() else 0
        left = f"{out} keeps what it wrote: " + ", ".join(
            f"{f} ({rollouts} rollouts)" if f == METRICS_FILE else f for f in files)
        if rollouts and resume:
            left += " (a new run into it needs --overwrite-output-dir, or --load to resume)"
    line = f"rlperf {command}: stopped by {name}; {left}"
    if resume:
        line += f". {resume_hint(ns)}"
    print(line, file=sys.stderr)
    return code


def _gate(args: argparse.Namespace) -> int:
    created = _new_dirs(args.output_dir)
    try:
        with _sigterm_raises():
            return _gate_command(args)
    except (Terminated, KeyboardInterrupt) as exc:
        _remove_if_empty(created)
        return _stopped("gate", exc, args, resume=False)
    finally:
        _remove_if_empty(created)


def _gate_command(args: argparse.Namespace) -> int:
    from rlperf.loop.device import cpu_memory_warning
    from rlperf.loop.launch import placement_for
    from rlperf.loop.placement import ActorLayout, needs_launch

    warning = cpu_memory_warning(args)  # before anything is allocated
    if warning:
        print(f"rlperf gate: {warning}", file=sys.stderr, flush=True)
    if needs_launch(args):  # --actor-num-gpus-per-node N > 1: the gates run on every rank
        import copy

        from rlperf.gates.runner import gate_options_from
        from rlperf.loop import UsageError, resolve_args

        try:  # bad flags or layouts exit 2 here, before any rank starts
            gate_options_from(args)
            ns = resolve_args(copy.copy(args))
            return placement_for(ns).launch_actors(_gate_rank, args, ActorLayout.of(ns, "cpu"))
        except (UsageError, ValueError) as exc:
            print(f"rlperf gate: {exc}", file=sys.stderr)
            return 2
    return _gate_rank(args)


def _gate_rank(args: argparse.Namespace) -> int:
    """``rlperf gate`` in one process, or in each actor rank (:func:`_gates_on_ranks`); rank 0 names the
    output directory once the flags are checked."""
    return _in_rank_group(args, _announced_gates_on_ranks)


def _announced_gates_on_ranks(ns: argparse.Namespace, place) -> int:
    return _gates_on_ranks(ns, place, announce=True)


def _in_rank_group(ns: argparse.Namespace, body) -> int:
    """``body(ns, place)`` inside the actor ranks' process group (one process: a group of one); a
    nonzero code with several ranks leaves the group without its closing barrier (module placement)."""
    from rlperf.loop.placement import actor_process_group

    with actor_process_group(ns) as place:
        code = body(ns, place)
        if code and place.world_size > 1:
            raise SystemExit(code)
    return code


def _gates_on_ranks(ns: argparse.Namespace, place, announce: bool = False) -> int:
    """The first-step gates (:func:`rlperf.gates.runner.run_gate`) on a copy of ``ns``. With several
    ranks every rank runs the first step (its collectives need them all); rank 0 alone prints the table
    and writes the reports, and every rank returns rank 0's verdict (2, bad usage, returns at once: the
    launcher stops the others)."""
    import contextlib
    import copy
    import os

    from rlperf.gates.runner import run_gate

    ns = copy.copy(ns)
    announce = announce and place.rank == 0  # rlperf gate (not train): say where the first step writes
    if place.world_size == 1:
        return run_gate(ns, announce=announce)
    if place.rank != 0:
        ns.report_json = ns.junit_xml = ns.report_png = None
    with open(os.devnull, "w") as quiet, (contextlib.redirect_stdout(quiet) if place.rank != 0
                                          else contextlib.nullcontext()):
        code = run_gate(ns, announce=announce)
    if code == 2:
        return code
    from rlperf.loop.data_parallel import broadcast_from_rank0

    return int(broadcast_from_rank0(code))


def _train(args: argparse.Namespace) -> int:
    from rlperf.loop import UsageError
    from rlperf.loop.run_lock import RunDirLocked, release_run_dirs

    locks, created, stopped = [], _new_dirs(args.output_dir, args.save), None
    try:
        with _sigterm_raises():
            return _train_command(args, locks)
    except (UsageError, RunDirLocked) as exc:
        print(f"rlperf train: {exc}", file=sys.stderr)
        return 2
    except (Terminated, KeyboardInterrupt) as exc:  # SIGTERM, SIGINT (one inside a save is the save's own line)
        stopped = exc
    finally:
        release_run_dirs(locks)
        _remove_if_empty(created)
    return _stopped("train", stopped, args, resume=True)


def _train_command(args: argparse.Namespace, locks: list) -> int:
    """``rlperf train`` with SIGTERM raising (:func:`_train`): resolve the flags, warn of a large model on
    the CPU, lock the directories (into ``locks``), refuse to replace an earlier run's metrics, run."""
    from rlperf.loop import resolve_args
    from rlperf.loop.device import cpu_memory_warning
    from rlperf.loop.launch import placement_for
    from rlperf.loop.placement import ActorLayout, needs_launch
    from rlperf.loop.resolve import check_earlier_metrics
    from rlperf.loop.run_lock import lock_run_dirs

    ns = resolve_args(args)
    if os.environ.get("RANK", "0") == "0":  # rank 0 (or the launcher) speaks and holds the directories
        warning = cpu_memory_warning(ns)  # before anything is allocated
        if warning:
            print(f"rlperf train: {warning}", file=sys.stderr, flush=True)
        lock_run_dirs(ns.output_dir, ns.save, locks)  # one run per --output-dir / --save
        check_earlier_metrics(ns)
    if needs_launch(ns):  # --actor-num-gpus-per-node N > 1: start N ranks here, each runs _train_rank
        placement = placement_for(ns)
        code = placement.launch_actors(_train_rank, ns, ActorLayout.of(ns, "cpu"))
        if code == 1 and not placement.rank_said_why:  # a rank failed or died (the placement named it): how to go on
            print(f"rlperf train: the run stops. {resume_hint(ns)}", file=sys.stderr)
        return code
    return _train_rank(ns)


def _train_rank(ns: argparse.Namespace) -> int:
    """``rlperf train`` once its flags are resolved: in one process, or in each actor rank (a rank
    started by the placement or by torchrun joins the ranks' process group first)."""
    return _in_rank_group(ns, _train_on_rank)


def _train_on_rank(ns: argparse.Namespace, place) -> int:
    from rlperf.loop import UsageError, train

    if not (ns.skip_gates or ns.debug_rollout_only or ns.debug_train_only):
        # the first-step gates run one rollout and one train step on a run of their own; the
        # training run then starts from the same initial state (nothing is saved by the gates)
        if place.rank == 0:  # seconds of work before the gates' table: say what they are
            print("rlperf train: first-step gates: one rollout and one train step, checked before step 1 "
                  "(--skip-gates skips them)", file=sys.stderr, flush=True)
        code = _gates_on_ranks(ns, place)
        if code != 0:
            if place.rank == 0:
                print(f"rlperf train: {'a first-step gate failed' if code == 1 else 'the gates could not run'}; "
                      f"stopping before step 1 (--skip-gates trains anyway)", file=sys.stderr)
            return code
    from rlperf.loop.checkpoint import CheckpointInterrupted
    from rlperf.loop.engines import EngineFleetError
    from rlperf.loop.health import RolloutProcessFailure
    from rlperf.model.moe import RoutingReplayError

    try:
        train(ns)
    except UsageError as exc:  # input errors found while building the run, before any step
        print(f"rlperf train: {exc}", file=sys.stderr)
        return 2
    except EngineFleetError as exc:  # --rollout-num-gpus: an engine or the router did not start (its output quoted)
        print(f"rlperf train: {exc}", file=sys.stderr)
        return 1
    except RolloutProcessFailure as exc:  # an engine or the router died or stopped answering mid-run
        print(f"rlperf train: {exc}; the run stops. {resume_hint(ns)}", file=sys.stderr)
        return 1
    except RoutingReplayError as exc:  # --use-rollout-routing-replay: a sample came without its routed experts
        print(f"rlperf train: --use-rollout-routing-replay: {exc}; the run stops. {resume_hint(ns)}", file=sys.stderr)
        return 1
    except CheckpointInterrupted as exc:  # disk full (ENOSPC) or SIGINT in a save: the pointer is untouched
        print(f"rlperf train: {exc}; the run stops. {resume_hint(ns)}", file=sys.stderr)
        return exc.exit_code
    return 0


def resume_hint(ns: argparse.Namespace) -> str:
    """How to go on after a run that stopped: the command with ``--load SAVE`` (its latest checkpoint),
    or why there is none to resume from."""
    import shlex

    from rlperf.loop.checkpoint import LATEST

    if not ns.save:
        return "It saved no checkpoints (no --save): a rerun starts from rollout 0"
    if not (Path(ns.save) / LATEST).is_file():
        return f"No checkpoint was written to --save {ns.save} yet: a rerun starts from rollout 0"
    argv = list(getattr(ns, "argv", None) or [])
    out, skip = [], False
    for a in argv:  # the same command, its --load replaced
        if skip:
            skip = False
            continue
        if a == "--load":
            skip = True
            continue
        if a.startswith("--load="):
            continue
        out.append(a)
    if not out:
        out = ["train", "..."]
    return f"Resume from its latest checkpoint: rlperf {shlex.join(out)} --load {shlex.quote(str(ns.save))}"


def _profile(args: argparse.Namespace) -> int:
    from rlperf.profiles.cli import run_profile

    return run_profile(args)


def _plot(args: argparse.Namespace) -> int:
    from rlperf.bench.harness import ratio_target
    from rlperf.plots.command import run_plot

    return run_plot(args, target=ratio_target)


def build_parser() -> argparse.ArgumentParser:
    from rlperf import flags

    parser = flags.ArgumentParser(
        prog="rlperf",
        description="rlperf: batch-invariant kernels, first-step gates and profiling for RL post-training of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"rlperf {__import__('rlperf').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from rlperf.bench.run import add_bench_arguments

    p = sub.add_parser(
        "bench",
        help="run the benchmarks on a GPU (kernels, layer stack, flatten, log-prob, rollout, sync, loop, MoE), each "
             "result next to its anchor from the same run",
        description=(
            "Run rlperf's benchmarks on the GPU. Every row is timed (CUDA events, warm-up, median of many "
            "repetitions; the cross-process weight sync by wall clock) next to its anchor measured in the same "
            "run: cuBLAS for matmul, SDPA (flash and cuDNN) for attention, the fast path for the invariant layer "
            "stack, one device copy of the same bytes for flatten and sync (plus its 50 ms budget), the lm-head "
            "matmul, naive torch, Liger and cut-cross-entropy (when installed) for logprob, the memory floor for "
            "rollout decode. Results go to a JSON file with card, versions and commit; --markdown rewrites this "
            "benchmark's section of bench/BENCHMARKS.md."
        ),
    )
    add_bench_arguments(p)
    p.set_defaults(func=_bench)

    from rlperf.rollout.args import add_serve_arguments

    p = sub.add_parser(
        "serve",
        help="start an SGLang-compatible rollout server (or N of them behind sglang-router with --router N)",
        description=(
            "Serve a Qwen3-style model over SGLang's HTTP API (/generate with log-probs, /health, /get_model_info, "
            "/get_server_info, pause/continue/flush/abort, start/stop_profile, update_weights_from_tensor with "
            "flattened buckets) on rlperf's batch-invariant kernels. With no flags it serves the embedded tiny model "
            "with the built-in byte tokenizer on 127.0.0.1:30000."
        ),
    )
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    from rlperf.gates.runner import DESCRIPTION as GATE_DESCRIPTION
    from rlperf.gates.runner import add_gate_command_arguments

    p = sub.add_parser(
        "gate",
        help="run one rollout and one train step and check kl_zero, logprob_abs_diff, oom_headroom, sanity "
             "(and routing_agreement on MoE models)",
        description=GATE_DESCRIPTION,
        formatter_class=flags.RawDescriptionHelpFormatter,
    )
    add_gate_command_arguments(p)
    p.set_defaults(func=_gate)

    from rlperf.loop import add_loop_arguments

    p = sub.add_parser(
        "train",
        help="run the RL loop: rollout -> rewards -> train -> weight sync (no flags: the embedded CPU task)",
        description=(
            "Run the RL loop with slime's flag names: prompts from --prompt-data jsonl, rollouts through an "
            "sglang-router (--sglang-router-ip/--sglang-router-port) or an in-process engine, rule or custom rewards, "
            "GRPO-family training, weight sync through flattened buckets after every update, metrics.jsonl and a phase "
            "timeline under --output-dir, checkpoints with --save. The first-step gates (rlperf gate) run first and a "
            "failing gate stops the run before step 1 (exit 1; --skip-gates). With no flags it trains the tiny model on the "
            "embedded key->letter task on the CPU for 80 rollouts: the mean reward rises from chance (0.25) to about "
            "0.95 (46 s on an idle 2-core Intel Xeon). Reproducible bit for bit on the same CPU model, or the same "
            "GPU model with the same torch and Triton (metrics.jsonl equal but for times and memory peaks); another "
            "CPU model may give other bits. A run into an --output-dir that holds an earlier run's metrics stops "
            "with exit 2 (--overwrite-output-dir, or --load to resume)."
        ),
    )
    from rlperf.gates.runner import add_gate_arguments

    add_gate_arguments(p)
    p.add_argument("--skip-gates", action="store_true", help="train without running the first-step gates first")
    add_loop_arguments(p)
    p.set_defaults(func=_train)

    from rlperf.profiles.cli import add_profile_command_arguments

    p = sub.add_parser(
        "profile",
        help="profile rollout servers behind a router: start/stop traces, run under load and merge, summarize",
        description=(
            "rlperf profile --router-url URL --action start|stop: start or stop torch.profiler on every worker the "
            "sglang-router lists (slime's tools/profile_rollout.py). rlperf profile run --router-url URL: start, "
            "drive load through the router, stop, collect every worker's trace, merge them into one Perfetto trace "
            "and print a summary. rlperf profile summarize TRACE...: the summary of existing traces."
        ),
    )
    add_profile_command_arguments(p)
    p.set_defaults(func=_profile)

    from rlperf.plots.command import add_plot_arguments

    p = sub.add_parser(
        "plot",
        help="draw runs (reward, KL, abs diff, tokens/s, step split) or bench results (ratios vs targets) as PNG + HTML",
        description=(
            "rlperf plot RUN_DIR...: one PNG (and an HTML page embedding it) of rlperf train runs from their "
            "metrics.jsonl: reward, KL and the train/rollout log-prob abs diff (log scale, exact zeros marked), "
            "response length, tokens/s, peak memory and the step split (rollout, log-prob, train, weight sync) as "
            "stacked areas; several runs overlay. rlperf plot BENCH.json...: each case's ratio to its anchor as "
            "bars, with its target. Needs matplotlib (pip install 'rlperf[plot]')."
        ),
    )
    add_plot_arguments(p)
    p.set_defaults(func=_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a resume hint repeats
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def run() -> None:
    """``python -m rlperf``: :func:`main`, then exit with its code. A rank that torchrun started
    (``TORCHELASTIC_RUN_ID``, several ranks) leaves through :func:`rlperf.loop.placement.leave_process`,
    as the ranks rlperf starts do: the interpreter's teardown after a gloo group can abort (SIGABRT),
    and torchrun would report a finished rank as failed."""
    code = main()
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("WORLD_SIZE", "1") != "1":
        from rlperf.loop.placement import leave_process

        leave_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
