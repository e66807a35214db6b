"""Benchmark reporting: ratios, tables and BENCHMARKS.md sections (CPU; timing itself needs CUDA)."""
import json

import pytest

from rlperf.bench.harness import BenchRow, cuda_time, format_table, geomean, write_json
from rlperf.bench.run import update_markdown


def _row(kernel_ms=2.0, anchor_ms=1.0):
    return BenchRow(bench="matmul", case="M=1024 N=4096 K=4096", kernel="triton", kernel_ms=kernel_ms,
                    anchor="cuBLAS", anchor_ms=anchor_ms, work=2 * 1024 * 4096 * 4096)


def test_ratio_is_anchor_over_kernel_and_rates():
    r = _row()
    assert r.ratio == 0.5
    assert r.rate(1.0) == pytest.approx(2 * 1024 * 4096 * 4096 / 1e-3 / 1e12)
    d = r.to_dict()
    assert d["ratio"] == 0.5 and d["anchor_rate"] == pytest.approx(2 * d["kernel_rate"])


def test_table_and_geomean():
    text = format_table([_row(), _row(1.0, 1.0)])
    assert "cuBLAS" in text and "0.500" in text and "1.000" in text
    assert geomean([0.25, 1.0]) == pytest.approx(0.5)


def test_markdown_section_replaced_in_place(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# t\n\nintro\n")
    update_markdown(md, "matmul", "<!-- bench:matmul start -->\nA\n<!-- bench:matmul end -->")
    update_markdown(md, "attention", "<!-- bench:attention start -->\nB\n<!-- bench:attention end -->")
    update_markdown(md, "matmul", "<!-- bench:matmul start -->\nC\n<!-- bench:matmul end -->")
    text = md.read_text()
    assert "intro" in text and "C" in text and "B" in text and "\nA\n" not in text
    assert text.index("C") < text.index("B")  # replaced where it stood


def test_json_has_environment_and_rows(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, [_row()], {"card": "X", "commit": "abc"}, {"geo": 0.5})
    data = json.loads(path.read_text())
    assert data["environment"]["card"] == "X" and data["rows"][0]["ratio"] == 0.5


def test_cuda_time_refuses_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="CPU timings"):
        cuda_time(lambda: None)
