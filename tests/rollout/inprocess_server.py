"""One in-process ``rlperf serve`` for tests: the real aiohttp app on a real local socket, the tiny
model on the CPU reference backend (shared by the hostile-client and warm-up tests)."""
import asyncio

from aiohttp.test_utils import TestClient, TestServer

from rlperf.rollout.args import ServerArgs
from rlperf.rollout.server import RolloutServer
from rlperf.rollout.tokenizer import ByteTokenizer


def cpu_args(**kw) -> ServerArgs:
    """Server args of the tests: reference kernels on the CPU, a 1024-token KV cache, overrides in ``kw``."""
    return ServerArgs(**{"kernel_backend": "reference", "device": "cpu", "max_total_tokens": 1024, **kw})


def serve(model, args: ServerArgs, fn):
    """Run ``await fn(server, client)`` against a fresh server on a real local socket; its result."""
    server = RolloutServer(args, model, ByteTokenizer(512))

    async def main():
        async with TestClient(TestServer(server.app)) as client:
            return await fn(server, client)

    return asyncio.run(main())
