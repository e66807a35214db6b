"""The rollout engine on the tiny model (CPU): determinism across batches, chunking and preemption;
rollout log-probs == the trainer's log-probs (packed forward + fused_logprob) bit for bit; stop
conditions; abort; validation."""
import dataclasses

import pytest
import torch

import rlperf.kernels as K
from rlperf.model import preset
from rlperf.model.qwen3 import Qwen3ForCausalLM
from rlperf.rollout.engine import BadRequest, Engine, EngineConfig, GenerationResult, SamplingParams
from rlperf.rollout.tokenizer import ByteTokenizer

CFG = preset("tiny")


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM.random(CFG, seed=0, std=0.1)  # std 0.1: peaked enough that greedy/top-k matter


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):
        yield


def _prompts(n, seed=0, lo=3, hi=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _engine(model, **kw):
    # NaN-poisoned pages: a read of a KV slot nobody wrote would turn the outputs into NaN
    cfg = {"max_total_tokens": 8192, "poison_kv_cache": K.mode() == "invariant", **kw}
    return Engine(model, ByteTokenizer(CFG.vocab_size), EngineConfig(**cfg))


def _run(engine, prompts, params):
    reqs = engine.generate(prompts, params)
    return [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs]


def _trainer_log_probs(model, prompts, responses, temperatures, max_tokens_per_gpu=256):
    """The trainer's log-probs of each prompt + response (``rlperf.train.compute_log_probs``: packed
    micro-batches, ``fused_logprob`` of the packed forward's hidden rows) at each request's
    temperature (greedy reports T = 1), one call per temperature: a list of [R_i] float32."""
    from rlperf.train import Sample, compute_log_probs

    samples = [Sample(torch.tensor(p + r), len(r)) for p, r in zip(prompts, responses)]
    temps = [t if t > 0 else 1.0 for t in temperatures]
    out = [None] * len(samples)
    for t in sorted(set(temps)):
        idx = [i for i, x in enumerate(temps) if x == t]
        for i, lp in zip(idx, compute_log_probs(model, [samples[i] for i in idx], t, max_tokens_per_gpu=max_tokens_per_gpu)):
            out[i] = lp
    return out


PARAMS = [SamplingParams(max_new_tokens=24, temperature=0.8, seed=11, ignore_eos=True),
          SamplingParams(max_new_tokens=17, temperature=1.0, top_p=0.9, top_k=50, seed=12, ignore_eos=True),
          SamplingParams(max_new_tokens=9, temperature=0.0, seed=13, ignore_eos=True)]


def test_seeded_request_is_the_same_alone_in_any_batch_and_with_or_without_chunking(model):
    target, target_params = _prompts(1, seed=1, lo=70, hi=71)[0], PARAMS[1]  # 70 tokens: crosses a page
    alone = _run(_engine(model, chunked_prefill_size=0), [target], target_params)[0]
    assert len(alone[0]) == 17 and len(set(alone[0])) > 1
    others = _prompts(9, seed=2)
    for chunk in (0, 16, 7):
        for where in (0, 5, 9):
            prompts = others[:where] + [target] + others[where:]
            params = [PARAMS[i % 3] for i in range(where)] + [target_params] + [PARAMS[i % 3] for i in range(where, 9)]
            got = _run(_engine(model, chunked_prefill_size=chunk), prompts, params)[where]
            assert got == alone, (chunk, where)


def test_different_seeds_give_different_samples(model):
    p = _prompts(1, seed=3)[0]
    a = _run(_engine(model), [p], dataclasses.replace(PARAMS[0], seed=1))[0][0]
    b = _run(_engine(model), [p], dataclasses.replace(PARAMS[0], seed=2))[0][0]
    assert a != b


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_rollout_logprobs_equal_training_forward_bits(model, temperature):
    prompts = _prompts(4, seed=4)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=5, ignore_eos=True)
    outs = _run(_engine(model, chunked_prefill_size=32), prompts, params)
    train = _trainer_log_probs(model, prompts, [o[0] for o in outs], [temperature] * len(prompts))
    seqs = [p + o[0] for p, o in zip(prompts, outs)]
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    with torch.no_grad():
        logits = model.logits(model.forward_packed(ids, positions, cu))
    for b, (p, o) in enumerate(zip(prompts, outs)):
        assert torch.equal(torch.tensor(o[1], dtype=torch.float32), train[b]), b
        if temperature == 0.0:  # greedy: every token is the argmax of its logits (at the position before it)
            start = int(cu[b]) + len(p) - 1
            assert o[0] == logits[start:start + len(o[0])].argmax(-1).tolist()


def test_rollout_logprobs_equal_the_trainers_alone_batched_chunked_retracted_and_graph_padded(model):
    """Requests of mixed temperatures (so the engine's per-temperature groups vary with the batch),
    decoded alone, together with chunked prefill, under retractions in a 2-page cache, and through
    the padded decode-graph path: the same tokens and log-probs every time, equal bit for bit to the
    trainer's packed-forward log-probs."""
    P = K.PAGE_SIZE
    prompts = _prompts(5, seed=40, lo=P // 2, hi=P)  # 5 x (P/2..P + 30..50) tokens never fit 2 pages at once
    temps = [0.0, 0.7, 1.0, 0.7, 1.3]
    params = [SamplingParams(max_new_tokens=30 + 5 * i, temperature=t, top_k=50 if i == 2 else -1, seed=60 + i,
                             ignore_eos=True) for i, t in enumerate(temps)]
    alone = [_run(_engine(model, chunked_prefill_size=0), [p], sp)[0] for p, sp in zip(prompts, params)]
    tight = _engine(model, max_total_tokens=2 * P, chunked_prefill_size=24)
    graphed = _engine(model, chunked_prefill_size=40, cuda_graph_max_bs=3)  # padded buckets 1, 2, 3
    calls, graph_run = [], graphed.graphs.run
    graphed.graphs.run = lambda *a: calls.append(len(a[0])) or graph_run(*a)
    runs = {"batched, chunked": _run(_engine(model, chunked_prefill_size=24), prompts, params),
            "retracted": _run(tight, prompts, params), "graph-padded": _run(graphed, prompts, params)}
    assert tight.num_retractions > 0 and {1, 2, 3} <= set(calls)
    for name, got in runs.items():
        assert got == alone, name
    train = _trainer_log_probs(model, prompts, [o[0] for o in alone], temps)
    for i, (ids, logprobs, _) in enumerate(alone):
        assert len(ids) == params[i].max_new_tokens
        assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), train[i]), i


def test_preemption_under_a_tiny_kv_cache_returns_the_same_tokens(model):
    P = K.PAGE_SIZE
    prompts = _prompts(6, seed=6, lo=P // 2, hi=P)  # 6 x (P/2..P + 50) tokens never fit in 2 pages at once
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=50) for i in range(6)]
    roomy_engine = _engine(model)
    roomy = _run(roomy_engine, prompts, params)
    assert roomy_engine.num_retractions == 0
    tight = _engine(model, max_total_tokens=2 * P, chunked_prefill_size=24)
    got = _run(tight, prompts, params)
    assert tight.num_retractions > 0
    assert got == roomy
    assert tight.kv.num_free_pages == tight.kv.num_pages and not tight.running and not tight.waiting


def test_retract_all_mid_flight_returns_the_same_typed_results(model):
    prompts, params = _prompts(4, seed=8), [PARAMS[i % 3] for i in range(4)]
    want = _engine(model).generate(prompts, params)
    assert all(isinstance(r, GenerationResult) and r.finish_type == "length" for r in want)
    engine = _engine(model)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(5):
        engine.step()
    running = len(engine.running)
    assert running > 0 and engine.retract_all() == running
    assert not engine.running and engine.kv.num_free_pages == engine.kv.num_pages
    engine.run_until_done()
    assert [r.result() for r in reqs] == want


def test_running_cap_is_respected(model):
    engine = _engine(model, max_running_requests=2)
    reqs = [engine.add_request(p, PARAMS[0]) for p in _prompts(5, seed=7)]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.running))
    assert peak == 2 and all(r.finished for r in reqs)


class _EosTokenizer(ByteTokenizer):
    def __init__(self, eos):
        super().__init__(CFG.vocab_size)
        self.eos_token_ids = (eos,)


def test_stop_token_ids_eos_ignore_eos_and_max_new_tokens(model):
    p = _prompts(1, seed=8)[0]
    base = _run(_engine(model), [p], dataclasses.replace(PARAMS[0], max_new_tokens=40))[0]
    ids = base[0]
    assert base[2] == {"type": "length", "length": 40}
    k = 5
    first = ids.index(ids[k])  # the first occurrence of that token ends the request
    got = _run(_engine(model), [p], dataclasses.replace(PARAMS[0], max_new_tokens=40, stop_token_ids=(ids[k],)))[0]
    assert got[0] == ids[:first + 1] and got[2] == {"type": "stop", "matched": ids[k]}
    assert got[1] == base[1][:first + 1]
    eos_engine = Engine(model, _EosTokenizer(ids[k]), EngineConfig(max_total_tokens=8192))
    params = dataclasses.replace(PARAMS[0], max_new_tokens=40, ignore_eos=False)
    got = _run(eos_engine, [p], params)[0]
    assert got[0] == ids[:first + 1] and got[2] == {"type": "stop", "matched": ids[k]}
    got = _run(eos_engine, [p], dataclasses.replace(params, ignore_eos=True))[0]
    assert got[0] == ids
    assert _run(_engine(model), [p], dataclasses.replace(PARAMS[0], max_new_tokens=0))[0] == ([], [], {"type": "length", "length": 0})


def test_stop_string_trims_the_text(model):
    tok = ByteTokenizer(CFG.vocab_size)
    p = _prompts(1, seed=9)[0]
    ids = _run(_engine(model), [p], dataclasses.replace(PARAMS[0], max_new_tokens=60))[0][0]
    i = next(i for i, t in enumerate(ids) if chr(t).isalnum() and t < 128)
    stop = chr(ids[i])
    engine = _engine(model)
    (req,) = engine.generate([p], dataclasses.replace(PARAMS[0], max_new_tokens=60, stop=(stop, "never-there")))
    assert req.output_ids == ids[:i + 1] and req.finish_reason == {"type": "stop", "matched": stop}
    assert req.text == tok.decode(ids[:i + 1])[:-1] and stop not in req.text
    (kept,) = _engine(model).generate([p], dataclasses.replace(PARAMS[0], max_new_tokens=60, stop=(stop,), no_stop_trim=True))
    assert kept.output_ids == ids[:i + 1] and kept.text == tok.decode(ids[:i + 1]) and kept.text.endswith(stop)
    # a stop string spanning several tokens: the text of the first 30 tokens' last 3 bytes-worth
    full = tok.decode(ids[:30])
    multi = full[-3:]
    first = full.find(multi)
    (req,) = _engine(model).generate([p], dataclasses.replace(PARAMS[0], max_new_tokens=60, stop=(multi,)))
    assert req.finish_reason == {"type": "stop", "matched": multi} and req.text == full[:first]
    assert len(req.output_ids) <= 30


def test_context_length_limits(model):
    engine = _engine(model, context_length=40)
    with pytest.raises(BadRequest, match="context length is 40"):
        engine.add_request(list(range(40)), PARAMS[0])
    (req,) = engine.generate([list(range(30))], dataclasses.replace(PARAMS[0], max_new_tokens=100))
    assert len(req.output_ids) == 10 and req.finish_reason == {"type": "length", "length": 10}


def test_abort_frees_pages_and_others_go_on(model):
    engine = _engine(model)
    finished = []
    a = engine.add_request(_prompts(1, seed=10)[0], PARAMS[0], rid="a", on_finish=finished.append)
    b = engine.add_request(_prompts(1, seed=11)[0], PARAMS[0], rid="b", on_finish=finished.append)
    for _ in range(3):
        engine.step()
    assert engine.abort("a") == 1 and a.finish_reason["type"] == "abort"
    assert engine.abort("missing") == 0
    engine.run_until_done()
    assert [r.rid for r in finished] == ["a", "b"] and len(b.output_ids) == 24
    assert engine.kv.num_free_pages == engine.kv.num_pages
    engine.add_request([1, 2], PARAMS[0], rid="c")
    with pytest.raises(BadRequest, match="already in flight"):
        engine.add_request([1, 2], PARAMS[0], rid="c")


def test_on_token_reports_every_token_but_the_last_one_through_retractions(model):
    P = K.PAGE_SIZE  # as in the preemption test: 6 requests that never fit in 2 pages at once
    prompts, params = _prompts(6, seed=6, lo=P // 2, hi=P), dataclasses.replace(PARAMS[0], max_new_tokens=50)
    engine = _engine(model, max_total_tokens=2 * P, chunked_prefill_size=24)
    seen, finished = {}, []
    reqs = [engine.add_request(p, params, rid=str(i), on_finish=finished.append,
                               on_token=lambda r: seen.setdefault(r.rid, []).append(len(r.output_ids)))
            for i, p in enumerate(prompts)]
    engine.run_until_done()
    assert engine.num_retractions > 0 and sorted(r.rid for r in finished) == [str(i) for i in range(6)]
    for r in reqs:  # once per token, in order; the last one comes with on_finish instead
        assert len(r.output_ids) == 50 and seen[r.rid] == list(range(1, 50))


def test_a_request_longer_than_the_whole_cache_is_aborted_with_a_message(model):
    P = K.PAGE_SIZE
    engine = _engine(model, max_total_tokens=P)
    req = engine.add_request([i % 256 for i in range(P - 4)], dataclasses.replace(PARAMS[0], max_new_tokens=10))
    reported = []
    while engine.has_work():
        reported += engine.step()
    assert reported == [req]  # step() reports every request it finished, this kind too
    # P tokens cached (prompt + 4 outputs) give a 5th token; the 6th would need a second page
    assert len(req.output_ids) == 5 and req.finish_reason["type"] == "abort"
    assert "cannot hold" in req.finish_reason["message"]
    with pytest.raises(BadRequest, match=f"KV cache holds {P}"):
        engine.add_request([i % 256 for i in range(P)], PARAMS[0])


@pytest.mark.parametrize("graphs", [0, 8])
@pytest.mark.parametrize("where", ["forward", "sample"])
def test_a_step_that_fails_on_one_request_fails_only_that_one_on_the_engine_thread(model, monkeypatch, where, graphs):
    """EngineLoop + Engine.recover: the failed batch's requests are retried alone; the culprit finishes
    with an abort carrying a status code, the others (preempting each other in 3 NaN-poisoned pages,
    so a stale KV slot would show) get the bits they get in a roomy engine. ``graphs`` 8: decode steps
    take the graph runner's path with overlap, so a sampling failure can hit a step launched ahead."""
    import concurrent.futures

    from rlperf.rollout.engine_loop import EngineLoop

    P, POISON = K.PAGE_SIZE, 300  # the bad prompt starts with a token the others never hold at position 0
    prompts = _prompts(6, seed=21, lo=P // 4, hi=P)
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=30) for i in range(6)]
    expect = _run(_engine(model), prompts, params)
    if where == "forward":
        forward = model.forward_paged

        def broken(ids, pos, *args, **kw):
            if bool(((ids == POISON) & (pos == 0)).any()):
                raise RuntimeError("a kernel failed")
            return forward(ids, pos, *args)
        monkeypatch.setattr(model, "forward_paged", broken)
    else:
        sample = K.sample

        def broken(logits, temperature, top_p, top_k, seeds, positions, **kw):
            if bool((seeds == 999).any()):
                raise ValueError("sample: invalid temperature [inf]")
            return sample(logits, temperature, top_p, top_k, seeds, positions, **kw)
        monkeypatch.setattr(K, "sample", broken)
    bad_prompt, bad_params = [POISON, 1, 2, 3, 4], dataclasses.replace(PARAMS[0], seed=999, max_new_tokens=30)
    engine = _engine(model, max_total_tokens=3 * P, chunked_prefill_size=24, cuda_graph_max_bs=graphs)
    loop = EngineLoop(engine, "reference")
    done = {i: concurrent.futures.Future() for i in range(7)}
    everything = list(zip(prompts, params)) + [(bad_prompt, bad_params)]
    order = [0, 1, 6, 2, 3, 4, 5]  # the bad one in the middle of the queue

    def add_all(e):
        for i in order:
            e.add_request(everything[i][0], everything[i][1], rid=str(i),
                          on_finish=lambda r, i=i: done[i].set_result(r.result()))
    loop.start()
    try:
        loop.pause("in_place").result(10)  # all queued before the first step: one batch
        loop.call(add_all).result(10)
        loop.resume().result(10)
        results = {i: f.result(60) for i, f in done.items()}
        state = loop.call(lambda e: (e.num_failed_steps, e.num_retractions, e.has_work(), e.kv.num_free_pages,
                                     e.kv.num_pages)).result(10)
        assert loop.alive  # the engine thread went on after the failures
    finally:
        loop.close()
    bad = results[6].finish_reason
    assert bad["type"] == "abort" and bad["status_code"] == 500, bad
    assert ("a kernel failed" if where == "forward" else "invalid temperature") in bad["message"]
    assert [(r.output_ids, r.output_logprobs, r.finish_reason) for r in (results[i] for i in range(6))] == expect
    failed, retractions, busy, free, pages = state
    assert failed >= 2 and retractions > 0 and not busy and free == pages


def test_fast_mode_runs_the_same_engine(model):
    prompts = _prompts(3, seed=14)
    with K.use_mode("fast"):
        outs = _run(_engine(model, chunked_prefill_size=16), prompts, PARAMS)
    assert [len(o[0]) for o in outs] == [24, 17, 9] and all(lp <= 0 for o in outs for lp in o[1])
    # greedy on a peaked model: the fast path picks the same tokens (not bits) as the invariant one
    assert outs[2][0] == _run(_engine(model), prompts[2:], PARAMS[2])[0][0]


def test_padded_decode_graph_path_gives_the_eager_bits(model):
    # on CPU the graph runner runs its padded static-buffer path eagerly: padding rows and bucket
    # sizes must not change a single bit of the real rows
    prompts = _prompts(7, seed=15)
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=6 + 3 * i) for i in range(7)]  # the batch shrinks
    eager = _run(_engine(model), prompts, params)
    graphed_engine = _engine(model, cuda_graph_max_bs=5)  # 7 running: steps of 7 run eagerly, <= 5 padded
    assert graphed_engine.graphs.buckets == [1, 2, 4, 5]
    calls = []
    run = graphed_engine.graphs.run
    graphed_engine.graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
    assert _run(graphed_engine, prompts, params) == eager
    assert {5, 4, 3, 2, 1} <= set(calls) and max(calls) == 5


def test_padded_prefill_graph_path_gives_the_eager_bits(model):
    # on CPU the prefill graph runner runs its padded static-buffer path eagerly: the padding sequence
    # (slot -1, attending over page 0, which the poisoned pool fills with NaN) and the empty sequence
    # slots must not change a single bit of the real rows; steps over the limit run eagerly
    from rlperf.rollout.cuda_graph import prefill_buckets, prefill_seq_slots

    assert prefill_buckets(100) == [64, 96, 100] and prefill_buckets(64) == [64]
    assert prefill_buckets(8448)[-4:] == [4096, 6144, 8192, 8448]
    assert [prefill_seq_slots(n, 64) for n in (0, 7, 8, 40, 63, 70)] == [8, 8, 16, 64, 64, 64]
    prompts = _prompts(9, seed=21, lo=20, hi=150)
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=4 + 2 * i) for i in range(9)]
    eager = _run(_engine(model, chunked_prefill_size=100), prompts, params)
    graphed_engine = _engine(model, chunked_prefill_size=100, cuda_graph_max_prefill_tokens=100)
    assert graphed_engine.prefill_graphs.buckets == [64, 96, 100]
    calls, run = [], graphed_engine.prefill_graphs.run
    graphed_engine.prefill_graphs.run = lambda c, r: calls.append((sum(len(x[0]) for x in c), len(c))) or run(c, r)
    steps = []
    step = graphed_engine.step
    graphed_engine.step = lambda: steps.append(1) or step()
    assert _run(graphed_engine, prompts, params) == eager
    # chunks with decode rows (up to 100 + 8 tokens: the larger steps run eagerly), whole short prompts,
    # and decode-only steps (no decode graphs here) all went through the padded path
    assert any(t > 96 for t, _ in calls) and any(t < 64 for t, _ in calls) and any(t == s for t, s in calls)
    assert len(calls) < len(steps)


def test_prefill_graph_padding_is_not_limited_by_a_short_context(model):
    # context 128 = one page per sequence; 8 prompts of 100 tokens fill a bucket of 1000 with 200 padding
    # tokens, whose sequence reads two pages of the graphs' table
    prompts = _prompts(8, seed=23, lo=100, hi=101)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    cfg = dict(context_length=128, chunked_prefill_size=1000)
    eager = _run(_engine(model, **cfg), prompts, params)
    graphed_engine = _engine(model, **cfg, cuda_graph_max_prefill_tokens=1000)
    assert graphed_engine.prefill_graphs.max_pages == 8  # cdiv(1000, 128), not the context's 1
    assert _run(graphed_engine, prompts, params) == eager


def test_prefill_graphs_take_only_what_they_can_replay(model):
    engine = _engine(model, cuda_graph_max_prefill_tokens=256, max_running_requests=5)
    g = engine.prefill_graphs
    assert g.max_slots == 8 and g.takes(256, 7) and not g.takes(257, 1) and not g.takes(10, 8)
    with pytest.raises(ValueError, match="up to 256 tokens in 7 sequences"):
        g.run([([1] * 300, 0, [0, 1, 2])], [299])
    assert engine._prefill_graphed(100, 2, None)
    with K.use_mode("fast"):  # fast mode replays graphs of its own (keyed by the mode)
        assert engine._prefill_graphed(100, 2, None)
    assert not engine._prefill_graphed(100, 2, routing=object())  # a step recording its routing runs eagerly
    assert _engine(model).prefill_graphs is None  # off by default


def test_fast_mode_takes_the_padded_prefill_graph_path(model):
    # fast mode promises no bits, so its padded steps (cuBLAS / the CPU's matmul at the bucket's row count)
    # are checked against the eager fast-mode engine to within rounding: the same tokens, close log-probs
    prompts = _prompts(6, seed=31, lo=20, hi=120)
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=3 + i) for i in range(6)]
    with K.use_mode("fast"):
        eager = _run(_engine(model, chunked_prefill_size=100), prompts, params)
        graphed_engine = _engine(model, chunked_prefill_size=100, cuda_graph_max_prefill_tokens=100)
        calls, run = [], graphed_engine.prefill_graphs.run
        graphed_engine.prefill_graphs.run = lambda c, r: calls.append(len(c)) or run(c, r)
        got = _run(graphed_engine, prompts, params)
    assert calls, "no fast-mode step took the prefill graphs' padded path"
    assert [o[0] for o in got] == [o[0] for o in eager] and [o[2] for o in got] == [o[2] for o in eager]
    for g, e in zip(got, eager):
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(e[1]), rtol=0, atol=1e-4)


def test_large_steps_launch_plainly():
    from rlperf.kernels.pipeline import programmatic_launch_switched_on
    from rlperf.rollout.cuda_graph import PDL_MAX_TOKENS, step_launches

    with K.use_programmatic_launch(True):
        with step_launches(PDL_MAX_TOKENS):
            assert programmatic_launch_switched_on()
        with step_launches(PDL_MAX_TOKENS + 1):
            assert not programmatic_launch_switched_on()
        assert programmatic_launch_switched_on()
    with K.use_programmatic_launch(False), step_launches(1):  # never switched on where it was off
        assert not programmatic_launch_switched_on()


def _stops_from(outputs, k):
    """A stop token per request: its output's token number ``k % len`` (so requests stop at different steps)."""
    return [out[0][(k + 3 * i) % len(out[0])] for i, out in enumerate(outputs)]


def test_overlap_gives_the_step_by_step_tokens_through_stops_arrivals_and_retractions(model):
    """Decode steps launched before the previous step's tokens are read (EngineConfig.overlap_schedule)
    give every request the tokens, log-probs, finish reasons and streaming callbacks of the step-by-step
    engine: requests stopping on tokens at different steps, more requests than may run (arrivals), a
    cache small enough to retract, mixed temperatures and limits."""
    P = K.PAGE_SIZE
    prompts = _prompts(9, seed=31, lo=P // 2, hi=P)
    params = [dataclasses.replace(PARAMS[i % 3], max_new_tokens=30 + 5 * i) for i in range(9)]
    free_running = _run(_engine(model), prompts, params)
    stops = _stops_from(free_running, 20)
    params = [dataclasses.replace(p, stop_token_ids=[t]) if i % 3 == 1 else p for i, (p, t) in enumerate(zip(params, stops))]

    def run(**kw):
        engine = _engine(model, max_running_requests=5, max_total_tokens=2 * P, chunked_prefill_size=40, **kw)
        seen = {}
        reqs = [engine.add_request(p, sp, rid=str(i), on_token=lambda r: seen.setdefault(r.rid, []).append(len(r.output_ids)))
                for i, (p, sp) in enumerate(zip(prompts, params))]
        engine.run_until_done()
        assert engine._in_flight is None and engine.kv.num_free_pages == engine.kv.num_pages
        for r in reqs:  # every token but the last, once, in order
            assert seen.get(r.rid, []) == list(range(1, len(r.output_ids))), r.rid
        return engine, [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs]

    eager = run()[1]
    assert sum(o[2]["type"] == "stop" for o in eager) == 3  # the stop tokens end requests early
    stepwise_engine, stepwise = run(cuda_graph_max_bs=8, overlap_schedule=False)
    overlap_engine, overlapped = run(cuda_graph_max_bs=8)
    assert stepwise == eager and overlapped == eager
    assert stepwise_engine.num_overlapped_steps == 0 and overlap_engine.num_overlapped_steps > 20
    assert overlap_engine.num_retractions > 0


def test_abort_retract_and_flush_drain_a_step_in_flight(model):
    prompts = _prompts(3, seed=32)
    params = [dataclasses.replace(PARAMS[0], max_new_tokens=30)] * 3
    expect = _run(_engine(model), prompts, params)
    engine = _engine(model, cuda_graph_max_bs=4)
    finished = []
    reqs = [engine.add_request(p, sp, rid=str(i), on_finish=finished.append) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine._in_flight is None:
        engine.step()
    n = len(reqs[0].output_ids)
    assert engine.abort("0") == 1 and engine._in_flight is None  # the step in flight was read first
    assert reqs[0].finish_reason["type"] == "abort" and len(reqs[0].output_ids) == n + 1
    assert reqs[0].output_ids == expect[0][0][:n + 1] and reqs[0].output_logprobs == expect[0][1][:n + 1]
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    assert engine.retract_all() == 2 and engine._in_flight is None and not engine.running
    with pytest.raises(BadRequest, match="cannot flush"):
        engine.flush()
    engine.run_until_done()
    assert [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs[1:]] == expect[1:]
    assert finished[0] is reqs[0] and {r.rid for r in finished[1:]} == {"1", "2"}
    engine.flush()
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_a_failed_read_of_the_step_in_flight_fails_no_request_on_the_engine_thread(model, monkeypatch):
    """The engine loop reads a step launched ahead (overlap) before each call between steps; when that
    read fails, Engine.recover takes it like a failed step: its requests retract and re-prefill, and
    every request ends with the tokens of a step-by-step engine."""
    import concurrent.futures

    from rlperf.rollout.engine import Engine as EngineClass
    from rlperf.rollout.engine_loop import EngineLoop

    prompts = _prompts(3, seed=33)
    params = [dataclasses.replace(PARAMS[i], max_new_tokens=40) for i in range(3)]
    expect = _run(_engine(model), prompts, params)
    engine = _engine(model, cuda_graph_max_bs=4)
    drain, read, failures = EngineClass.drain, EngineClass._read, []

    def drain_failing_once(self):  # the first drain that finds a step in flight fails while reading it
        self._fail_read = self._in_flight is not None and not failures
        try:
            return drain(self)
        finally:
            self._fail_read = False

    def flaky_read(self, sampled):
        if getattr(self, "_fail_read", False):
            failures.append(len(sampled.reqs))
            raise RuntimeError("device lost the copy")
        return read(self, sampled)
    monkeypatch.setattr(EngineClass, "drain", drain_failing_once)
    monkeypatch.setattr(EngineClass, "_read", flaky_read)
    loop = EngineLoop(engine, "reference")
    done = {i: concurrent.futures.Future() for i in range(3)}

    def add_all(e):
        for i in range(3):
            e.add_request(prompts[i], params[i], rid=str(i), on_finish=lambda r, i=i: done[i].set_result(r.result()))
    loop.start()
    try:
        loop.call(add_all).result(10)
        while not failures and not all(f.done() for f in done.values()):
            loop.call(lambda e: None).result(10)  # a call between steps: the loop drains first
        results = [done[i].result(60) for i in range(3)]
        failed, busy = loop.call(lambda e: (e.num_failed_steps, e.has_work())).result(10)
        assert loop.alive
    finally:
        loop.close()
    assert failures == [3] and failed == 1 and not busy
    assert [(r.output_ids, r.output_logprobs, r.finish_reason) for r in results] == expect


@pytest.mark.parametrize("bad, message", [
    ({"max_new_tokens": -1}, "max_new_tokens=-1"),
    ({"max_new_tokens": "5"}, "must be an integer"),
    ({"max_new_tokens": 2.5}, "must be an integer"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"stop": [1]}, "stop must be"),
    ({"stop_token_ids": "3"}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"no_stop_trim": "yes"}, "no_stop_trim"),
    ({"seed": "x"}, "seed"),
    ({"frequency_penalty": 0.5}, "not supported"),
    ({"bogus": 1}, "unsupported keys"),
    ([1], "must be an object"),
])
def test_sampling_params_validation(bad, message):
    with pytest.raises(BadRequest, match=message):
        SamplingParams.from_dict(bad)


def test_sampling_params_from_sglang_names():
    # what slime sends
    sp = SamplingParams.from_dict({"max_new_tokens": 3, "sampling_seed": 7, "top_k": -1, "stop": "x", "temperature": 1.0,
                                   "top_p": 1.0, "stop_token_ids": [5], "skip_special_tokens": False, "no_stop_trim": True,
                                   "spaces_between_special_tokens": False})
    assert sp == SamplingParams(max_new_tokens=3, seed=7, top_k=-1, stop=("x",), stop_token_ids=(5,),
                                skip_special_tokens=False, no_stop_trim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter_engine_matches_the_trainers_log_probs(model, interpreter, dtype):
    # the Triton kernels (interpreted) instead of the reference: short runs, fp32 and fp16 (the
    # interpreter's bf16 is wrong: DESIGN, Measured facts); two temperatures in one batch
    m = model if dtype == torch.float32 else Qwen3ForCausalLM.random(CFG, seed=0, std=0.1, dtype=dtype)
    prompts = _prompts(3, seed=12, lo=5, hi=20)
    params = [SamplingParams(max_new_tokens=4, temperature=t, seed=3 + i, ignore_eos=True)
              for i, t in enumerate([0.9, 0.0, 0.9])]
    with K.use_backend("interpreter"):
        batched = _run(_engine(m, chunked_prefill_size=8), prompts, params)
        alone = _run(_engine(m), prompts[1:2], params[1])[0]
        train = _trainer_log_probs(m, prompts, [o[0] for o in batched], [p.temperature for p in params])
    assert alone == batched[1]
    for i, o in enumerate(batched):
        assert torch.equal(torch.tensor(o[1], dtype=torch.float32), train[i]), i


def test_interpreter_engine_takes_the_log_probs_from_its_logits(interpreter, monkeypatch):
    """With a vocabulary whose lm-head product has the fused log-prob's BLOCK_K (16,400 words), the engine
    folds its step's logits (``fused_logprob_of_logits``) instead of reading the lm head again: the same
    tokens and log-probs as the second pass, and the trainer's bits; two temperatures in one batch."""
    cfg = dataclasses.replace(CFG, vocab_size=16400)
    m = Qwen3ForCausalLM.random(cfg, seed=1, std=0.1, dtype=torch.float16)
    prompts = _prompts(3, seed=5, lo=4, hi=12)
    params = [SamplingParams(max_new_tokens=3, temperature=t, seed=20 + i, ignore_eos=True)
              for i, t in enumerate([0.8, 0.0, 0.8])]
    folded = []
    real = K.fused_logprob_of_logits

    def counted(*a, **kw):
        folded.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(K, "fused_logprob_of_logits", counted)
    with K.use_backend("interpreter"):
        engine = Engine(m, ByteTokenizer(cfg.vocab_size), EngineConfig(max_total_tokens=2048, poison_kv_cache=True))
        assert engine._logits_are_the_fused_tiles(m.head_weight)
        assert not K.logits_give_fused_logprob(Qwen3ForCausalLM.random(CFG, seed=0, dtype=torch.float16).head_weight)
        got = _run(engine, prompts, params)
        assert folded, "the engine did not take its log-probs from the logits"
        second_pass = _run(Engine(m, ByteTokenizer(cfg.vocab_size),
                                  EngineConfig(max_total_tokens=2048, logprob_from_logits_max_rows=0)), prompts, params)
        train = _trainer_log_probs(m, prompts, [o[0] for o in got], [p.temperature for p in params])
    assert got == second_pass
    for i, o in enumerate(got):
        assert torch.equal(torch.tensor(o[1], dtype=torch.float32), train[i]), i


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_gives_the_eager_bits():
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=2, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = _prompts(12, seed=16, lo=10, hi=200)
    params = [SamplingParams(max_new_tokens=20 + 5 * i, temperature=1.0, seed=30 + i, ignore_eos=True) for i in range(12)]
    with K.use_backend(None):
        eager = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15)).generate(prompts, params)
        graphed = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=16))
        got = graphed.generate(prompts, params)
    assert len(graphed.graphs.graphs) >= 3  # several buckets were captured and replayed
    assert [(r.output_ids, r.output_logprobs) for r in got] == [(r.output_ids, r.output_logprobs) for r in eager]


def test_a_failed_capture_is_recorded_warned_and_left_to_eager_steps(model, caplog):
    """``capture_or_fall_back``: a capture that raises is recorded under its key with the error's text and
    warned about once (its first line), and does not raise; one that succeeds says so. The engine lists the
    recorded failures of both graph kinds (``Engine.graph_failures``, the server's ``cuda_graph_failures``), and
    its steps go on (on the CPU the padded paths run eagerly anyway)."""
    import logging

    from rlperf.graph_capture import capture_or_fall_back

    def boom():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nthe rest of the trace")

    engine = _engine(model, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=128)
    assert engine.graph_failures() == []
    with caplog.at_level(logging.WARNING, logger="rlperf.graph_capture"):
        assert capture_or_fall_back(engine.graphs.failed, ("invariant", 4, True), "decode step", boom) is False
        assert capture_or_fall_back(engine.prefill_graphs.failed, ("invariant", 64, 8), "prefill step",
                                    lambda: 1 / 0) is False
    assert engine.graphs.failed == {("invariant", 4, True): "RuntimeError: CUDA error: operation not permitted when "
                                                            "stream is capturing\nthe rest of the trace"}
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["CUDA graph capture of the decode step ('invariant', 4, True) failed; those steps run eagerly: "
                      "RuntimeError: CUDA error: operation not permitted when stream is capturing",
                      "CUDA graph capture of the prefill step ('invariant', 64, 8) failed; those steps run eagerly: "
                      "ZeroDivisionError: division by zero"], warned
    assert engine.graph_failures() == [
        {"graphs": "decode", "key": ["invariant", 4, True], "error": engine.graphs.failed[("invariant", 4, True)]},
        {"graphs": "prefill", "key": ["invariant", 64, 8], "error": "ZeroDivisionError: division by zero"}]
    done = []
    assert capture_or_fall_back(engine.graphs.failed, ("invariant", 2, True), "decode step",
                                lambda: done.append(1)) is True
    assert done == [1] and len(engine.graph_failures()) == 2
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert _run(engine, _prompts(3), [params] * 3) == _run(_engine(model), _prompts(3), [params] * 3)


@pytest.mark.gpu
def test_gpu_failed_captures_run_those_steps_eagerly_with_the_eager_bits(monkeypatch, caplog):
    """Captures that fail for real. Decode bucket 1: a host sync inside the capture, which CUDA forbids there
    (the capture is invalidated and ``capture_end`` raises before ``torch.cuda.graph`` restores the stream and the
    allocator: the fallback must). Every prefill bucket: a Python error inside the capture. Those steps run
    eagerly: the engine's tokens and log-probs are the eager engine's bit for bit, the other decode buckets
    still capture and replay, the caller's stream is the default one again, and ``graph_failures`` lists them."""
    import logging

    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=2, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = _prompts(12, seed=16, lo=10, hi=200)
    params = [SamplingParams(max_new_tokens=20 + 5 * i, temperature=1.0, seed=30 + i, ignore_eos=True) for i in range(12)]
    real_logits, real_forward = model.logits, model.forward_paged

    def logits(hidden):
        if torch.cuda.is_current_stream_capturing() and hidden.shape[0] == 1:
            torch.cuda.synchronize()  # not permitted while the stream captures
        return real_logits(hidden)

    def forward_paged(ids, *args, **kw):
        if torch.cuda.is_current_stream_capturing() and ids.shape[0] >= 64:  # prefill buckets: >= 64 tokens
            raise RuntimeError("an op this capture cannot take")
        return real_forward(ids, *args, **kw)

    with K.use_backend(None):
        eager = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15)).generate(prompts, params)
        monkeypatch.setattr(model, "logits", logits)
        monkeypatch.setattr(model, "forward_paged", forward_paged)
        graphed = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=16,
                                                  cuda_graph_max_prefill_tokens=512))
        with caplog.at_level(logging.WARNING, logger="rlperf.graph_capture"):
            got = graphed.generate(prompts, params)
    assert [(r.output_ids, r.output_logprobs) for r in got] == [(r.output_ids, r.output_logprobs) for r in eager]
    failures = graphed.graph_failures()
    decode = [f for f in failures if f["graphs"] == "decode"]
    assert [f["key"] for f in decode] == [["invariant", 1, True]], failures
    prefill = [f for f in failures if f["graphs"] == "prefill"]
    assert prefill and all("an op this capture cannot take" in f["error"] for f in prefill), failures
    assert not graphed.prefill_graphs.graphs
    assert len(graphed.graphs.graphs) >= 2 and ("invariant", 1, True) not in graphed.graphs.graphs
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert sum("failed; those steps run eagerly" in r.getMessage() for r in caplog.records) == len(failures)


# greedy, 3-14 new tokens: the last requests decode on their own, through the decode graphs
FAST_GREEDY = [SamplingParams(max_new_tokens=3 + i, temperature=0.0, ignore_eos=True) for i in range(12)]


def _eager_and_prefill_graphed(mode, params, cfg=None, dtype=torch.bfloat16):
    """12 prompts of 10-700 tokens (chunks of 300 mixed with decode rows) through a 2-layer engine (default: the
    qwen3-0.6b shape, bf16) in kernel ``mode`` on the GPU, eagerly and with prefill graphs (and decode graphs up
    to 4 sequences): (eager results, graphed results, the captured prefill graphs' keys (mode, bucket, slots),
    the decode graphs' keys (mode, batch, logits))."""
    cfg = cfg or dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=4, dtype=dtype, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = _prompts(12, seed=22, lo=10, hi=700)
    with K.use_backend(None), K.use_mode(mode):
        eager = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, chunked_prefill_size=300)).generate(prompts, params)
        graphed = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, chunked_prefill_size=300, cuda_graph_max_bs=4,
                                                  cuda_graph_max_prefill_tokens=300 + 12))
        got = graphed.generate(prompts, params)
    return eager, got, list(graphed.prefill_graphs.graphs), list(graphed.graphs.graphs)


@pytest.mark.gpu
def test_gpu_prefill_graphs_give_the_eager_bits():
    """Chunked prefills mixed with decode rows, whole short prompts and decode steps over the decode graphs'
    largest bucket, replayed from prefill graphs of several token buckets and slot counts: the eager
    engine's tokens and log-probs, bit for bit."""
    params = [SamplingParams(max_new_tokens=8 + 3 * i, temperature=(1.0, 0.0)[i % 2], seed=40 + i, ignore_eos=True)
              for i in range(12)]
    eager, got, keys, _ = _eager_and_prefill_graphed("invariant", params)
    assert len({b for _, b, _ in keys}) >= 3 and len({s for _, _, s in keys}) >= 2, sorted(keys)
    assert [(r.output_ids, r.output_logprobs) for r in got] == [(r.output_ids, r.output_logprobs) for r in eager]


@pytest.mark.gpu
def test_gpu_fast_mode_prefill_graphs_replay_the_eager_steps():
    """Fast mode's steps with prefill chunks replayed from its own prefill graphs (cuBLAS products, rlperf's
    paged attention): greedy first tokens of 12 prompts, chunked and mixed with decode rows, against the eager
    fast-mode engine. Fast mode promises no bits (a padded step's cuBLAS products may round otherwise), so
    the log-probs are compared to bf16 rounding and the tokens where they are not near-ties."""
    _check_fast_mode_graphed_steps(*_eager_and_prefill_graphed("fast", FAST_GREEDY))


def _check_fast_mode_graphed_steps(eager, got, prefill_keys, decode_keys):
    """Fast-mode graphs were captured and replayed, and the first tokens' log-probs are the eager engine's to
    bf16 rounding, the greedy tokens equal outside near-ties (fast mode promises no bits)."""
    assert prefill_keys and all(mode == "fast" for mode, _, _ in prefill_keys), sorted(prefill_keys)
    assert decode_keys and all(mode == "fast" for mode, _, _ in decode_keys), sorted(decode_keys)
    first = [(g.output_ids[0], e.output_ids[0], g.output_logprobs[0], e.output_logprobs[0]) for g, e in zip(got, eager)]
    for g_tok, e_tok, g_lp, e_lp in first:
        assert abs(g_lp - e_lp) < 0.05, first
    assert sum(g_tok == e_tok for g_tok, e_tok, _, _ in first) >= 10, first


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fast_mode_moe_engine_captures_and_replays_its_steps(dtype):
    """A MoE model in fast mode: its expert blocks stay on the device (``torch._grouped_mm`` in bf16; in float16
    the kernels, as the stock per-expert loop reads the expert counts on the host, which no CUDA graph can
    hold), so its prefill and decode steps are captured and replayed; checked against the eager engine as the
    dense fast-mode steps are."""
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=256, norm_topk_prob=True)
    _check_fast_mode_graphed_steps(*_eager_and_prefill_graphed("fast", FAST_GREEDY, cfg, dtype))


@pytest.mark.gpu
def test_gpu_bf16_engine_determinism_and_on_policy_logprobs():
    cfg = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=2)
    model = Qwen3ForCausalLM.random(cfg, seed=1, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = _prompts(16, seed=13, lo=20, hi=300)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=21, ignore_eos=True)
    with K.use_backend(None):
        full = Engine(model, tok, EngineConfig(max_total_tokens=1 << 16, chunked_prefill_size=128)).generate(prompts, params)
        alone = Engine(model, tok, EngineConfig(max_total_tokens=1 << 16, chunked_prefill_size=0)).generate(prompts[7:8], params)[0]
        tight = Engine(model, tok, EngineConfig(max_total_tokens=8 * K.PAGE_SIZE, chunked_prefill_size=64))
        pre = tight.generate(prompts, params)
        assert tight.num_retractions > 0
        assert (alone.output_ids, alone.output_logprobs) == (full[7].output_ids, full[7].output_logprobs)
        assert [r.output_ids for r in pre] == [r.output_ids for r in full]
        assert [r.output_logprobs for r in pre] == [r.output_logprobs for r in full]
        seq = prompts[7] + full[7].output_ids
        with torch.no_grad():
            h = model.forward_packed(torch.tensor(seq, device="cuda"), torch.arange(len(seq), device="cuda"),
                                     torch.tensor([0, len(seq)], dtype=torch.int32, device="cuda"))
            train = K.fused_logprob(h[len(prompts[7]) - 1:-1], model.head_weight,
                                    torch.tensor(full[7].output_ids, device="cuda"), 1.0)
        assert torch.equal(torch.tensor(full[7].output_logprobs, dtype=torch.float32, device="cuda"), train)


@pytest.mark.gpu
def test_gpu_bf16_qwen3_0_6b_graphed_rollout_logprobs_equal_the_trainers():
    """The full qwen3-0.6b shape in bf16, the engine with CUDA-graph decode at ``rlperf serve``'s default
    cuda_graph_max_bs and prefill graphs (serve's default for its chunk and batch): 5 requests, then 32 (the 5
    among them, same seeds) of prompt lengths 20..300,
    mixed temperatures, 64 new tokens. Every output log-prob equals the trainer's, bit for bit: its
    old-log-prob pass (``compute_log_probs``, packed micro-batches of up to 8192 tokens) and its
    training forward (grad on, with entropy, as the train step computes it)."""
    from rlperf.rollout.cuda_graph import DEFAULT_MAX_BS, default_max_prefill_tokens
    from rlperf.train import Sample, micro_batch_log_probs, pack_micro_batches

    cfg = preset("qwen3-0.6b")
    model = Qwen3ForCausalLM.random(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = _prompts(32, seed=17, lo=20, hi=300)
    temps = [(1.0, 0.7, 0.0)[i % 3] for i in range(32)]
    params = [SamplingParams(max_new_tokens=64, temperature=t, seed=100 + i, ignore_eos=True) for i, t in enumerate(temps)]
    few = [0, 7, 8, 20, 31]
    with K.use_backend(None), K.use_mode("invariant"):
        engine = Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=DEFAULT_MAX_BS,
                                                 cuda_graph_max_prefill_tokens=default_max_prefill_tokens("cuda", 512, 64)))
        small = engine.generate([prompts[i] for i in few], [params[i] for i in few])
        assert engine.graphs.graphs, "no decode step was replayed from a CUDA graph"
        assert engine.prefill_graphs.graphs, "no prefill step was replayed from a CUDA graph"
        assert engine._logits_are_the_fused_tiles(model.head_weight)  # log-probs folded from the step's logits
        big = engine.generate(prompts, params)
        assert len(engine.graphs.graphs) >= 2  # the 5-request and the 32-request buckets
        for k, i in enumerate(few):
            assert (small[k].output_ids, small[k].output_logprobs) == (big[i].output_ids, big[i].output_logprobs), i
        train = _trainer_log_probs(model, prompts, [r.output_ids for r in big], temps, max_tokens_per_gpu=8192)
        for i, r in enumerate(big):
            assert len(r.output_ids) == 64
            assert torch.equal(torch.tensor(r.output_logprobs, dtype=torch.float32), train[i]), i
        # the train step's forward: grad on, entropy on (fused_logprob's autograd path), one temperature
        ones = [i for i, t in enumerate(temps) if t == 1.0]
        samples = [Sample(torch.tensor(prompts[i] + big[i].output_ids), 64) for i in ones]
        (mb,) = pack_micro_batches(samples, max_tokens_per_gpu=8192, device="cuda")
        logp, _ent = micro_batch_log_probs(model, mb, 1.0, with_entropy=True)
        want = torch.cat([torch.tensor(big[ones[k]].output_logprobs, dtype=torch.float32) for k in mb.indices])
        assert torch.equal(logp.detach().cpu(), want)


def test_fused_sampling_gives_the_same_tokens_and_log_probs(model, interpreter, monkeypatch):
    """``EngineConfig(fused_sampling=True)`` under the kernels (interpreted, float32: the lm-head product and
    the fused tile share BLOCK_K, so the same logits): the same tokens and log-probs as the sampler and the
    log-prob pass. A step whose rows share one temperature and ask for no top-p / top-k takes the one-pass
    kernel; a step with several temperatures or a filtered row takes the logits (every call is recorded
    with its rows' temperatures); the reference backend never takes it."""
    calls = []
    fused = K.fused_sample_logprob
    monkeypatch.setattr(K, "fused_sample_logprob",
                        lambda *a: calls.append(sorted(set(a[2].tolist()))) or fused(*a))
    prompts = _prompts(3, seed=21, lo=5, hi=20)
    one_t = [SamplingParams(max_new_tokens=4, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(3)]
    greedy = [SamplingParams(max_new_tokens=3, temperature=0.0, seed=50 + i, ignore_eos=True) for i in range(3)]
    mixed = [SamplingParams(max_new_tokens=3, temperature=t, seed=60 + i, ignore_eos=True)
             for i, t in enumerate([0.8, 1.0, 0.0])]
    # PARAMS' three kinds, shorter (the interpreter runs every kernel): the top-p / top-k request ends after the
    # greedy one, then the 0.8 request decodes alone for 3 steps
    filtered = [dataclasses.replace(p, max_new_tokens=n) for p, n in zip(PARAMS, (8, 5, 3))]
    with K.use_backend("interpreter"):
        for params in (one_t, greedy, mixed, filtered):
            calls.clear()
            plain = _run(_engine(model, chunked_prefill_size=8), prompts, params)
            assert not calls
            got = _run(_engine(model, chunked_prefill_size=8, fused_sampling=True), prompts, params)
            assert got == plain
            assert calls and all(len(temps) == 1 for temps in calls), calls  # one temperature per fused step
            if params is one_t or params is greedy:  # every sampling step fused: one at least per token drawn
                assert len(calls) >= max(p.max_new_tokens for p in params), calls
            if params is filtered:  # the top-p / top-k request (temperature 1.0) never goes through it
                assert all(temps != [1.0] for temps in calls), calls
            if params is mixed:  # the steps holding all three requests took the logits
                assert len(calls) < sum(p.max_new_tokens for p in params)
    calls.clear()
    assert _run(_engine(model, fused_sampling=True), prompts, one_t) == _run(_engine(model), prompts, one_t)
    assert not calls  # the reference backend (this module's default): the logits path


def test_fast_mode_folds_the_steps_logits_for_its_log_probs(interpreter, monkeypatch):
    """Fast mode (no bits promised) takes a step's log-probs from the logits it sampled from (the fold's kernels,
    interpreted here) instead of a second pass over the lm head (``fused_logprob``'s stock path): the same tokens
    as that second pass, log-probs within float rounding of it, and ``fused_logprob`` never called; with
    ``logprob_from_logits_max_rows=0`` every step takes the second pass again. A float32 lm head, which the fold
    does not take, keeps the second pass."""
    calls = []
    second_pass = K.fused_logprob
    monkeypatch.setattr(K, "fused_logprob", lambda *a, **kw: calls.append(a[0].shape[0]) or second_pass(*a, **kw))
    half = Qwen3ForCausalLM.random(CFG, seed=0, std=0.1, dtype=torch.float16)
    prompts = _prompts(3, seed=23, lo=5, hi=20)
    with K.use_backend("interpreter"), K.use_mode("fast"):
        folded = _run(_engine(half, chunked_prefill_size=8), prompts, PARAMS)
        assert not calls
        again = _run(_engine(half, chunked_prefill_size=8, logprob_from_logits_max_rows=0), prompts, PARAMS)
        assert calls
        for (ids, logps, why), (ids2, logps2, why2) in zip(folded, again):
            assert (ids, why) == (ids2, why2) and len(logps) == len(ids)
            torch.testing.assert_close(torch.tensor(logps), torch.tensor(logps2), atol=2e-3, rtol=0)
        calls.clear()
        _run(_engine(Qwen3ForCausalLM.random(CFG, seed=0, std=0.1), chunked_prefill_size=8), prompts, PARAMS[:1])
        assert calls


def _graphed_runs_default_and(model, prompts, params, **option):
    """Each request's (output ids, output log-probs) from a graphed engine on the Triton kernels (``model`` on the
    GPU) with the default EngineConfig, then with ``option`` set: two lists to compare bit for bit."""
    tok = ByteTokenizer(model.cfg.vocab_size)
    with K.use_backend(None):
        return [[(r.output_ids, r.output_logprobs) for r in
                 Engine(model, tok, EngineConfig(max_total_tokens=1 << 15, cuda_graph_max_bs=32, **config))
                 .generate(prompts, params)]
                for config in ({}, option)]


@pytest.mark.gpu
def test_gpu_bf16_graphed_fused_sampling_gives_the_default_engines_tokens_and_log_probs():
    """The qwen3-0.6b shape in bf16 with decode graphs: ``fused_sampling`` (graphs without logits, one pass
    over the lm head) gives the default engine's tokens and log-probs bit for bit, for a batch of one
    temperature (the fused kernel) and a greedy one."""
    model = Qwen3ForCausalLM.random(preset("qwen3-0.6b"), seed=0, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(24, seed=5, lo=20, hi=300)
    for t in (1.0, 0.0):
        params = [SamplingParams(max_new_tokens=40, temperature=t, seed=100 + i, ignore_eos=True) for i in range(24)]
        default, fused = _graphed_runs_default_and(model, prompts, params, fused_sampling=True)
        assert default == fused, t


@pytest.mark.gpu
def test_gpu_bf16_fold_beside_the_sampler_gives_the_default_engines_tokens_and_log_probs():
    """``logprob_beside_sampler`` (the logits' fold on a side stream while the sampler runs, merged with the
    drawn tokens after both) gives the default engine's tokens and log-probs bit for bit, with decode graphs,
    for one temperature and for a batch of two (which folds after the draw, per temperature)."""
    model = Qwen3ForCausalLM.random(preset("qwen3-0.6b"), seed=0, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(24, seed=6, lo=20, hi=300)
    for temps in ((0.8,), (1.0, 0.5)):
        params = [SamplingParams(max_new_tokens=40, temperature=temps[i % len(temps)], seed=200 + i, ignore_eos=True)
                  for i in range(24)]
        default, beside = _graphed_runs_default_and(model, prompts, params, logprob_beside_sampler=True)
        assert default == beside, temps
