"""The phase meter: wall time and peak memory per phase (the loop's perf/* and memory/* metrics, the
gates' per-phase peaks and probe), its timeline slices, and peaks that cover overlapping phases."""
import mmap
import threading
import time

import pytest
import torch

from rlperf.telemetry import PhaseMeter, PhaseTimeline, peak_rss_bytes, reset_peak_rss, rss_bytes

MiB = 2**20


def test_cpu_phase_sees_an_allocation_inside_the_block():
    meter = PhaseMeter()
    before = rss_bytes()
    with meter.phase("train") as s:
        # a fresh anonymous mapping, every page touched: new resident memory whatever the allocator
        # already holds (a torch or malloc block could reuse freed pages that are still resident)
        block = mmap.mmap(-1, 32 * MiB)
        for offset in range(0, 32 * MiB, mmap.PAGESIZE):
            block[offset] = 1
        block.close()  # gone before the phase ends: only a peak can see it
    assert meter.kind == "cpu_rss"
    assert s.name == "train" and s.peak_bytes >= before + 30 * MiB and s.seconds > 0
    assert meter.peaks == {"train": s.peak_bytes} and meter.times == {"train": s.seconds}


def test_times_add_up_and_peaks_take_the_max_until_reset():
    meter = PhaseMeter("cpu")
    with meter.phase("rollout") as a:
        time.sleep(0.01)
    with meter.phase("rollout") as b:
        time.sleep(0.01)
    assert meter.times["rollout"] == pytest.approx(a.seconds + b.seconds) and meter.times["rollout"] >= 0.02
    assert meter.peaks["rollout"] == max(a.peak_bytes, b.peak_bytes)
    meter.reset()
    assert meter.times == {} and meter.peaks == {}


def test_a_failing_phase_records_nothing_and_closes():
    meter = PhaseMeter()
    with pytest.raises(RuntimeError):
        with meter.phase("train") as s:
            raise RuntimeError("boom")
    assert s.peak_bytes is None and meter.peaks == {} and meter._open == 0


def test_each_phase_is_a_timeline_slice_with_its_step(tmp_path):
    timeline = PhaseTimeline(tmp_path / "t.json", sample_memory=lambda: {"host rss MiB": 1.0})
    meter = PhaseMeter("cpu", timeline)
    with meter.phase("rollout", 3):
        pass
    with meter.phase("probe"):
        pass
    assert [(s.name, s.args) for s in timeline.slices] == [("rollout", {"step": 3}), ("probe", {})]
    assert len(timeline.counters) == 4  # memory counters at both edges of both phases


def test_an_overlapping_phase_does_not_reset_an_open_phase_peak():
    """--async: the rollout thread opens its phase while training runs; the train phase's peak must
    still cover its whole span, so the meter resets the peak only when no phase is open."""
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable: the peak cannot be reset here")
    meter = PhaseMeter()
    opened, allocated = threading.Event(), threading.Event()
    with meter.phase("train") as train:
        x = torch.ones(64 * MiB // 4)
        del x  # the train phase's peak, before the other phase opens
        peak_before = peak_rss_bytes()

        def rollout():
            with meter.phase("rollout"):
                opened.set()
                allocated.wait()

        t = threading.Thread(target=rollout)
        t.start()
        opened.wait()
        allocated.set()
        t.join()
    assert train.peak_bytes >= peak_before


@pytest.mark.gpu
def test_cuda_phase_sees_an_allocation_inside_the_block():
    dev = torch.device("cuda")
    meter = PhaseMeter(dev)
    keep = torch.ones(2**20, device=dev)  # allocated before: not part of the phase's growth
    with meter.phase("rollout") as m:
        x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        del x
    assert meter.kind == "cuda" and m.peak_bytes >= 256 * MiB + keep.numel() * 4
    with meter.phase("log_prob") as m2:
        pass
    assert m2.peak_bytes < 256 * MiB  # the peak was reset at the phase's start


def test_process_memory_on_the_cpu_is_the_resident_set_against_the_hosts_memory():
    """What a rollout server reports in /get_server_info: the readings the meter takes, and the capacity."""
    from rlperf.telemetry import process_memory, system_memory_bytes

    buf = mmap.mmap(-1, 64 * MiB)
    buf.write(b"\1" * (64 * MiB))  # resident now
    m = process_memory("cpu")
    assert (m["kind"], m["reserved_bytes"], m["capacity_bytes"]) == ("cpu_rss", None, system_memory_bytes())
    assert 64 * MiB < m["current_bytes"] <= m["peak_bytes"] <= peak_rss_bytes()  # VmHWM, as the meter reads it
    buf.close()


@pytest.mark.gpu
def test_process_memory_on_cuda_is_the_allocators_counters_against_the_devices_memory():
    from rlperf.telemetry import process_memory

    dev = torch.device("cuda")
    x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    m = process_memory(dev)
    assert m["kind"] == "cuda" and m["capacity_bytes"] == torch.cuda.get_device_properties(dev).total_memory
    assert 256 * MiB <= m["current_bytes"] <= m["peak_bytes"] and m["current_bytes"] <= m["reserved_bytes"]
    assert m["peak_bytes"] == torch.cuda.max_memory_allocated(dev)
    del x
