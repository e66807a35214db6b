"""rlperf train through the real sglang-router: two `rlperf serve` workers, weights pushed as
shared-memory buckets after every update; the run matches the in-process engine's, bit for bit."""

import pytest

from rlperf.loop import train
from rlperf.rollout.args import ServerArgs

pytest.importorskip("aiohttp")
pytest.importorskip("sglang_router")

VOLATILE = ("perf/", "memory/")


@pytest.fixture(scope="module")
def cluster(launch_router_cluster):
    # a different random init than the trainer's: the loop's first weight sync must replace it
    args = ServerArgs(model_path="tiny", kernel_backend="reference", num_threads=1, device="cpu", random_seed=5)
    with launch_router_cluster(args) as c:
        yield c


def test_router_run_equals_in_process_run(cluster, tmp_path):
    port = cluster.router_url.rsplit(":", 1)[1]
    # the runs compare bits, not learning: 4 prompts x 4 samples a rollout instead of the embedded 8 x 16
    flags = ["--no-progress", "--num-rollout", "2", "--true-on-policy-mode", "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "4", "--global-batch-size", "16"]
    routed = train(["--output-dir", str(tmp_path / "r"), "--sglang-router-ip", "127.0.0.1",
                    "--sglang-router-port", str(port), *flags])
    local = train(["--output-dir", str(tmp_path / "l"), *flags])
    stable = lambda h: [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in h]  # noqa: E731
    assert stable(routed) == stable(local)
    assert [m["train/train_rollout_logprob_abs_diff"] for m in routed] == [0.0, 0.0]
