"""The engine's decode and prefill steps under variants of its decode path (the two fusions, programmatic
dependent launch, the fused log-prob's split width, the fused draw, decode attention's one-query guess and
tile orientation, the log-prob's source), same card, same process: is a change of the rollout bench's times theirs or the card's?

* ``swiglu``: :func:`rlperf.kernels.linear_silu_mul` (the gate_up product with its SwiGLU epilogue, one
  launch) against ``silu_mul(linear(x, w))`` (two launches). The engine takes the epilogue for at most
  ``SWIGLU_EPILOGUE_MAX_ROWS`` rows; the variants that name it take it at every size;
* ``kv``: :func:`rlperf.kernels.rmsnorm_rope_store_kv` (Q's and K's norm + RoPE and the K/V cache store,
  one launch) against ``rmsnorm_rope`` twice and ``write_kv_cache`` (three launches);
* ``no pdl``: the engine's default kernels without programmatic dependent launch
  (:func:`rlperf.kernels.use_programmatic_launch`; ``RLPERF_PDL=0``). The default launches with it on SM 90+
  GPUs: a kernel's blocks may start while the previous kernel's last blocks run, and the decode graphs
  are captured with it;
* ``fused sampling``: the engine's ``fused_sampling`` (:func:`rlperf.kernels.fused_sample_logprob`: the
  token and its log-prob from one pass over the lm head, the decode graphs without the [B, V] logits)
  against the default's logits in the graph, then the sampler and the log-prob's own pass; the same
  log-prob bits, and the same tokens wherever the fused tile's logits are the lm-head product's bits;
* ``logprob split N`` (any N >= 1, e.g. ``logprob split 5``): the fused log-prob's forward
  (:func:`rlperf.kernels.fused_logprob`, the engine's log-prob of each sampled token, read from the lm
  head a second time) with vocabulary splits of N tiles of 256 columns instead of its config's
  ``SPLIT_TILES`` (5 for 16-bit inputs): one program per (128-token tile, split), so at decode batches (one
  token tile) the split width alone sets how many programs stream the lm head (5 tiles: 119 programs on
  the 151,936-word vocabulary; 16 tiles, the width before these measurements: 38);
* ``no decode guess``: decode attention's launches without ``GUESS_ONE_QUERY`` (each program then finds
  its sequence by the binary search over the batch's query offsets, ceil(log2 B) dependent loads before
  its first K/V load, instead of checking the one-query-per-sequence numbering with two loads; the same
  sequence either way, so the same bits);
* ``logprob from the lm head``: the sampled tokens' log-probs by a second pass over the lm head
  (:func:`rlperf.kernels.fused_logprob`) at every batch (``EngineConfig.logprob_from_logits_max_rows`` 0),
  where the engine's default folds the step's logits (:func:`rlperf.kernels.fused_logprob_of_logits`, the
  same bits) at every batch;
* ``logprob beside the sampler``: the engine's ``logprob_beside_sampler``: the fold of the step's logits
  (:func:`rlperf.kernels.fold_logits`, which needs no tokens) on a side CUDA stream beside the sampler's
  kernels, the merge with the drawn tokens after both (the same bits);
* ``decode row tiles``: decode attention's launches with more programs than SMs on the 64-row tile at one
  stage, as before the keys-on-M default; ``decode keys on m``: the keys on the MMA's M side in the
  few-programs launch too (kernels/attention.py; the same bits in all three);
* ``two matmul buckets``: the products' tile configs as they were before the tiny-M and stretched small-M
  buckets (:func:`rlperf.kernels.matmul_config`): the small-M tiles for at most 64 rows, no swapped tiles
  (``gemm.TINY_M`` 0, so no shape's either) and no shape's small-M tiles past 64 rows. The same bits (every config of a shape
  shares its reduction: tests/kernels/test_matmul.py).

Both fused forms give the bits of their unfused calls (their kernel tests), PDL moves no instruction of a
kernel's math, and the log-prob from the logits is the second pass's bits, so those variants decode the same
tokens and log-probs; only the launches differ. A
log-prob split changes the order in which the log-sum-exp adds the splits, so its log-probs differ in the
last bits from the default's (the tokens do not: they are drawn from the logits).
Each variant is timed with the rollout bench's own cases
(:func:`rlperf.bench.rollout.decode_case`, CUDA graphs on, and :func:`prefill_case`), in invariant mode
on the qwen3-0.6b shape with random weights. Ratios are to the engine's default of the same run::

    python -m rlperf.bench.fusion_ab [--batches 1,64,256] [--steps 16] [--prefill 16] [--variants 'no pdl'] [--rounds 2]

The variants are timed in ``--rounds`` rounds, each in a rotated order (round r starts at the r-th variant,
:func:`timing_orders`), and the table gives each case's median over the rounds: the variant timed first in
a process read up to 7% high at B = 1 on an H200 even after an untimed round (identical steps, 1.540 against
1.431 ms), and a rotation puts that cost on each variant in turn.

Needs a CUDA GPU (exit 2 without one).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import statistics
import sys
from typing import NamedTuple

import torch

from rlperf import kernels as K

class Variant(NamedTuple):
    """swiglu: None is the engine's own choice (the epilogue up to ``SWIGLU_EPILOGUE_MAX_ROWS`` rows), True
    the epilogue at every size, False never; kv: the K/V-store fusion; pdl: launches with programmatic
    dependent launch (the engine's default; it applies on SM 90+ GPUs only); logprob_split_tiles: the
    fused log-prob's vocabulary tiles per forward split (None: its config's); fused_sampling: the
    engine's ``EngineConfig.fused_sampling``; decode_guess: decode attention's ``GUESS_ONE_QUERY``;
    logprob_from_logits_max_rows: ``EngineConfig``'s (None: its default); matmul_buckets: the products'
    tiny-M and stretched small-M configs (False: the two buckets of before, ``two matmul buckets``);
    logprob_beside_sampler: ``EngineConfig``'s; decode_keys_on_m: decode attention's ``KEYS_ON_M`` in both
    decode launches (None: their own); decode_many_stages: the pipeline depth of the decode launch with more
    programs than SMs (None: its own)."""

    swiglu: bool | None
    kv: bool
    pdl: bool = True
    logprob_split_tiles: int | None = None
    fused_sampling: bool = False
    decode_guess: bool = True
    logprob_from_logits_max_rows: int | None = None
    matmul_buckets: bool = True
    logprob_beside_sampler: bool = False
    decode_keys_on_m: bool | None = None
    decode_many_stages: int | None = None


ENGINE_DEFAULT = "engine default"
VARIANTS = {ENGINE_DEFAULT: Variant(None, True), "both fusions": Variant(True, True),
            "no swiglu epilogue": Variant(False, True), "no kv-store fusion": Variant(True, False),
            "neither": Variant(False, False), "no pdl": Variant(None, True, pdl=False),
            "fused sampling": Variant(None, True, fused_sampling=True),
            "no decode guess": Variant(None, True, decode_guess=False),
            "logprob from the lm head": Variant(None, True, logprob_from_logits_max_rows=0),
            "two matmul buckets": Variant(None, True, matmul_buckets=False),
            "logprob beside the sampler": Variant(None, True, logprob_beside_sampler=True),
            "decode keys on m": Variant(None, True, decode_keys_on_m=True),
            "decode row tiles": Variant(None, True, decode_keys_on_m=False, decode_many_stages=1)}
"""The named variants (``all`` times these); ``logprob split N`` variants are made on request
(:func:`chosen_variants`)."""
_LOGPROB_SPLIT = re.compile(r"logprob split (\d+)")


def _unfused_linear_silu_mul(x, w):
    return K.silu_mul(K.linear(x, w))


def _unfused_store_kv(q, q_weight, k, k_weight, positions, cos, sin, eps, v, k_cache, v_cache, slot_mapping):
    K.write_kv_cache(K.rmsnorm_rope(k, k_weight, positions, cos, sin, eps), v, k_cache, v_cache, slot_mapping)
    return K.rmsnorm_rope(q, q_weight, positions, cos, sin, eps)


@contextlib.contextmanager
def variant(swiglu: bool | None, kv: bool, pdl: bool = True, logprob_split_tiles: int | None = None,
            decode_guess: bool = True, matmul_buckets: bool = True, decode_keys_on_m: bool | None = None,
            decode_many_stages: int | None = None):
    """The engine's layers call ``K.linear_silu_mul`` and ``K.rmsnorm_rope_store_kv`` through the
    kernels package: swap in the unfused calls (or lift the epilogue's row limit), switch
    programmatic dependent launch, set the fused log-prob's split width (every dtype's config), decode
    attention's one-query guess and tile orientation and the products' M buckets, for the variant's duration."""
    from rlperf.kernels import attention, fused_lm_head, gemm

    saved = K.linear_silu_mul, K.rmsnorm_rope_store_kv, gemm.SWIGLU_EPILOGUE_MAX_ROWS
    saved_buckets = gemm.TINY_M, dict(gemm._SMALL_M_UP_TO), dict(gemm._TINY_M_UP_TO)
    saved_configs = dict(fused_lm_head._CONFIGS)
    decode_configs = (attention._DECODE_CONFIG, attention._DECODE_FEW_PROGRAMS, attention._DECODE_MANY_PROGRAMS)
    saved_guesses = [c["GUESS_ONE_QUERY"] for c in decode_configs]
    saved_orientations = [c.get("KEYS_ON_M", False) for c in decode_configs]
    saved_many_stages = attention._DECODE_MANY_PROGRAMS["num_stages"]
    try:
        if decode_many_stages is not None:
            attention._DECODE_MANY_PROGRAMS["num_stages"] = decode_many_stages
        for c in decode_configs:
            c["GUESS_ONE_QUERY"] = decode_guess
            if decode_keys_on_m is not None:
                c["KEYS_ON_M"] = decode_keys_on_m
        if swiglu is False:
            K.linear_silu_mul = _unfused_linear_silu_mul
        elif swiglu:
            gemm.SWIGLU_EPILOGUE_MAX_ROWS = 1 << 62
        if not kv:
            K.rmsnorm_rope_store_kv = _unfused_store_kv
        if not matmul_buckets:
            gemm.TINY_M = 0
            gemm._SMALL_M_UP_TO.clear()
            gemm._TINY_M_UP_TO.clear()
        if logprob_split_tiles is not None:
            for dtype, cfg in saved_configs.items():
                fused_lm_head._CONFIGS[dtype] = dataclasses.replace(cfg, SPLIT_TILES=logprob_split_tiles)
        with K.use_programmatic_launch(pdl):
            yield
    finally:
        K.linear_silu_mul, K.rmsnorm_rope_store_kv, gemm.SWIGLU_EPILOGUE_MAX_ROWS = saved
        gemm.TINY_M = saved_buckets[0]
        gemm._SMALL_M_UP_TO.clear()
        gemm._SMALL_M_UP_TO.update(saved_buckets[1])
        gemm._TINY_M_UP_TO.clear()
        gemm._TINY_M_UP_TO.update(saved_buckets[2])
        fused_lm_head._CONFIGS.clear()
        fused_lm_head._CONFIGS.update(saved_configs)
        attention._DECODE_MANY_PROGRAMS["num_stages"] = saved_many_stages
        for c, guess, keys_on_m in zip(decode_configs, saved_guesses, saved_orientations):
            c["GUESS_ONE_QUERY"] = guess
            c["KEYS_ON_M"] = keys_on_m


def chosen_variants(spec: str) -> dict[str, Variant] | None:
    """The engine's default and the variants ``spec`` names (``all``: every one of :data:`VARIANTS`; names
    separated by commas), in
    :data:`VARIANTS`' order, then the ``logprob split N`` ones in the order given; None when a name is not
    a variant (or N is not a positive integer)."""
    names = [" ".join(n.split()) for n in spec.split(",") if n.strip()]
    splits = {}
    for n in names:
        match = _LOGPROB_SPLIT.fullmatch(n)
        if match and int(match.group(1)) >= 1:
            splits[n] = Variant(None, True, logprob_split_tiles=int(match.group(1)))
        elif n not in VARIANTS and n != "all":
            return None
    if not names:
        return None
    return {**{n: v for n, v in VARIANTS.items() if n == ENGINE_DEFAULT or n in names or "all" in names}, **splits}


def timing_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The variants' order in each timed round: round r is ``names`` rotated to start at ``names[r % n]``, so
    over n rounds (n variants) each variant is timed first once and after every other variant once."""
    n = len(names)
    return [names[r % n:] + names[:r % n] for r in range(rounds)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlperf.bench.fusion_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64,256", help="decode batch sizes, comma-separated (default 1,64,256)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per case (default 16)")
    p.add_argument("--prefill", type=int, default=16, help="prompts of the prefill case (0: none; default 16)")
    p.add_argument("--variants", default="all",
                   help="comma-separated variants to time besides the engine's default (default all): "
                        + ", ".join(repr(n) for n in VARIANTS if n != ENGINE_DEFAULT)
                        + ", and 'logprob split N' (N tiles of 256 words per log-prob split)")
    p.add_argument("--rounds", type=int, default=2,
                   help="timed rounds, each in a rotated variant order; the table shows the median (default 2)")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batches: positive integers separated by commas, got {args.batches!r}")
    if args.steps < 1:
        p.error(f"--steps: at least 1, got {args.steps}")
    if args.prefill < 0:
        p.error(f"--prefill: 0 or more prompts, got {args.prefill}")
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, got {args.rounds}")
    variants = chosen_variants(args.variants)
    if variants is None:
        p.error(f"--variants: names from {', '.join(n for n in VARIANTS if n != ENGINE_DEFAULT)}, "
                f"'logprob split N' with N >= 1 (or all), "
                f"separated by commas, got {args.variants!r}")
    if not torch.cuda.is_available():
        print("fusion_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM

    from .rollout import MODEL, NEW, PROMPT, decode_case, prefill_case

    model = Qwen3ForCausalLM.random(preset(MODEL), seed=0, dtype=torch.bfloat16, device="cuda")
    # the rollout bench's new tokens: every request still decodes while the last prefill chunks run
    new_tokens = max(NEW, args.steps + 8)
    prefill = f"prefill {args.prefill}x{PROMPT}"
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    with K.use_mode("invariant"):
        # one untimed round first (every variant's kernels compiled, the allocator warm); the timed rounds'
        # rotation then spreads what the first variant of a round still pays (module docstring)
        for v in variants.values():
            with variant(*v[:4], decode_guess=v.decode_guess, matmul_buckets=v.matmul_buckets,
                         decode_keys_on_m=v.decode_keys_on_m, decode_many_stages=v.decode_many_stages):
                decode_case(model, max(batches), PROMPT, new_tokens, 1, graph_bs=max(batches),
                            fused_sampling=v.fused_sampling,
                            logprob_from_logits_max_rows=v.logprob_from_logits_max_rows,
                            logprob_beside_sampler=v.logprob_beside_sampler)
                if args.prefill:
                    prefill_case(model, args.prefill, PROMPT, reps=1)
        for r, order in enumerate(timing_orders(list(variants), args.rounds), 1):
            for name in order:
                v = variants[name]
                with variant(*v[:4], decode_guess=v.decode_guess, matmul_buckets=v.matmul_buckets,
                             decode_keys_on_m=v.decode_keys_on_m, decode_many_stages=v.decode_many_stages):
                    row = samples[name]
                    for b in batches:
                        d = decode_case(model, b, PROMPT, new_tokens, args.steps, graph_bs=max(batches),
                                        fused_sampling=v.fused_sampling,
                                        logprob_from_logits_max_rows=v.logprob_from_logits_max_rows,
                                        logprob_beside_sampler=v.logprob_beside_sampler)
                        row.setdefault(f"decode B={b}", []).append(d["ms"])
                        print(f"fusion_ab: round {r}: {name}: decode B={b} {d['ms']:.3f} ms "
                              f"({d['launches'].kernels if d['launches'] else '?'} kernels per step)", flush=True)
                    if args.prefill:
                        ms = prefill_case(model, args.prefill, PROMPT, reps=3)
                        row.setdefault(prefill, []).append(ms)
                        print(f"fusion_ab: round {r}: {name}: {prefill} {ms:.3f} ms", flush=True)
    times = {name: {case: statistics.median(ms) for case, ms in row.items()} for name, row in samples.items()}
    base = times[ENGINE_DEFAULT]
    cases = list(base)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | ms, the median of {args.rounds} round(s) "
          f"(ratio to the engine's default)")
    print("| variant | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for name, row in times.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f} ({row[c] / base[c]:.2f}x)" for c in cases) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
