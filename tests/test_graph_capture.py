"""``rlperf.graph_capture``: what a failed capture leaves (the record, the warning) and what it lets through.
The captures themselves fail for real in the GPU tests (tests/rollout/test_engine.py,
tests/train/test_cuda_graph_train.py)."""
import logging

import pytest

from rlperf.graph_capture import capture_or_fall_back


def test_the_failure_is_recorded_under_its_key_and_warned_once_with_the_hint(caplog):
    failed = {}

    def boom():
        raise MemoryError("the graph pool could not grow\nsecond line")

    with caplog.at_level(logging.WARNING, logger="rlperf.graph_capture"):
        assert capture_or_fall_back(failed, ("invariant", 1024, 8), "train micro-step", boom,
                                    "--cuda-graph-buckets none keeps every step eager") is False
    assert failed == {("invariant", 1024, 8): "MemoryError: the graph pool could not grow\nsecond line"}
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graph capture of the train micro-step ('invariant', 1024, 8) failed; those steps run eagerly "
        "(--cuda-graph-buckets none keeps every step eager): MemoryError: the graph pool could not grow"]


def test_a_capture_that_succeeds_records_nothing_and_an_interrupt_is_not_swallowed(caplog):
    failed, done = {}, []
    with caplog.at_level(logging.WARNING, logger="rlperf.graph_capture"):
        assert capture_or_fall_back(failed, 4, "decode step", lambda: done.append(4)) is True

        def interrupted():
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):  # a user's Ctrl-C is not a capture failure
            capture_or_fall_back(failed, 8, "decode step", interrupted)
    assert done == [4] and failed == {} and not caplog.records
