"""``GenerateRequest.from_json``: a ``/generate`` body normalised to one entry per prompt (no server)."""
import pytest

pytest.importorskip("aiohttp")

from rlperf.rollout.engine import BadRequest, SamplingParams  # noqa: E402
from rlperf.rollout.generate_request import GenerateRequest  # noqa: E402
from rlperf.rollout.tokenizer import ByteTokenizer  # noqa: E402


def test_single_text_request_with_sglang_client_extras():
    # what sglang.bench_serving sends (lora_path, logprob_start_len, ... are accepted and ignored)
    req = GenerateRequest.from_json({"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                                     "stream": True, "lora_path": None, "return_logprob": False,
                                     "logprob_start_len": -1, "return_routed_experts": False})
    assert not req.is_batch and req.stream and len(req) == 1 and req.input_ids is None and req.text == ["hi"]
    assert req.sampling_params == [SamplingParams(max_new_tokens=3, temperature=0.0)]
    assert req.return_logprob == [False] and req.rid == [None]
    assert req.prompt_ids(ByteTokenizer(512)) == [[104, 105]]


def test_batch_of_ids_broadcasts_or_takes_per_prompt_fields():
    req = GenerateRequest.from_json({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2},
                                     "return_logprob": [True, False], "rid": "r", "stream": None})
    assert req.is_batch and not req.stream and req.input_ids == [[1, 2], [3]] and req.text is None
    assert req.sampling_params == [SamplingParams(max_new_tokens=2)] * 2
    assert req.return_logprob == [True, False] and req.rid == ["r-0", "r-1"]
    assert GenerateRequest.from_json({"input_ids": [[1], [2]], "rid": ["a", "b"]}).rid == ["a", "b"]
    assert not GenerateRequest.from_json({"input_ids": [1, 2]}).is_batch


@pytest.mark.parametrize("body, message", [
    ({}, "exactly one of 'text' and 'input_ids'"),
    ({"text": []}, "'text' must be a string or a non-empty list of strings"),
    ({"input_ids": "12"}, "'input_ids' must be a list of token ids"),
    ({"input_ids": []}, "'input_ids' must hold non-empty lists of integers"),
    ({"input_ids": [1, True]}, "'input_ids' must hold non-empty lists of integers"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "'sampling_params' has 1 entries for 2 prompts"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p=0.0 is outside"),
    ({"text": "a", "return_logprob": 1}, "'return_logprob' must be a boolean, got 1"),
    ({"text": ["a", "b"], "rid": ["x"]}, "'rid' must be a string"),
    ({"text": "a", "stream": 1}, "'stream' must be a boolean, got 1"),
])
def test_bad_bodies_name_the_field(body, message):
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace("[", r"\[")):
        GenerateRequest.from_json(body)


def test_an_error_after_the_stream_started_is_sent_as_an_event_and_the_request_is_aborted():
    """In-process server whose tokenizer fails on the event loop (the engine thread's decode works)."""
    import asyncio
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from rlperf.model import preset
    from rlperf.model.qwen3 import Qwen3ForCausalLM
    from rlperf.rollout.args import ServerArgs
    from rlperf.rollout.server import RolloutServer

    class FailingTokenizer(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            if threading.current_thread().name != "rlperf-engine":
                raise RuntimeError("decoder broke")
            return super().decode(ids, skip_special_tokens)

    server = RolloutServer(ServerArgs(kernel_backend="reference", device="cpu", max_total_tokens=1024),
                           Qwen3ForCausalLM.random(preset("tiny"), seed=0), FailingTokenizer(512))

    async def run():
        async with TestClient(TestServer(server.app)) as client:
            resp = await client.post("/generate", json={"input_ids": [1, 2], "stream": True,
                                                        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
            assert resp.status == 200
            events = (await resp.text()).split("\n\n")
            for _ in range(100):  # the abort reaches the engine between two steps
                if not server.engine.has_work():
                    break
                await asyncio.sleep(0.05)
            return events, server.engine.has_work(), server.engine.num_steps

    events, busy, steps = asyncio.run(run())
    assert events[-3:] == ['data: {"error": {"message": "RuntimeError: decoder broke", "code": 500}}', "data: [DONE]", ""]
    assert not busy and steps < 200
