"""The gates' verdicts as a console table, a JSON report and JUnit XML (one testcase per gate)."""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import xml.etree.ElementTree as ET

from .checks import GateResult

JUNIT_SUITE = "rlperf.gate"
"""The JUnit testsuite name (and each testcase's classname), so CI dashboards group the gates."""


def _jsonable(v):
    """JSON has no NaN/inf: write them as strings ("nan", "inf") so the report stays strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


@dataclasses.dataclass
class GateReport:
    """All gates' results for one first step; ``seconds``: wall time of the first step (the gates'
    checks after it are not counted); ``stage_seconds``: where it went, the first step's stages
    (:attr:`rlperf.loop.record.FirstStepRecord.stage_seconds`) and ``other``, the rest of ``seconds``
    (building the record, closing the engines); ``setup_seconds``: the ``setup`` stage split
    (:attr:`rlperf.loop.record.FirstStepRecord.setup_seconds`)."""

    results: list[GateResult]
    seconds: float = 0.0
    config: dict = dataclasses.field(default_factory=dict)
    stage_seconds: dict = dataclasses.field(default_factory=dict)
    setup_seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def exit_code(self) -> int:
        """0 every gate passed, 1 at least one failed (the CLI's rule)."""
        return 0 if self.passed else 1

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.passed]

    def to_dict(self) -> dict:
        return _jsonable({"passed": self.passed, "failed": self.failed, "seconds": self.seconds,
                          "stage_seconds": self.stage_seconds, "setup_seconds": self.setup_seconds,
                          "gates": [r.to_dict() for r in self.results], "config": self.config})

    def table(self) -> str:
        """One line per gate (``PASS``/``FAIL``, name, message), then each failure's hint."""
        width = max((len(r.name) for r in self.results), default=4)
        lines = [f"{'gate':<{width}}  result  details", f"{'-' * width}  ------  -------"]
        for r in self.results:
            lines.append(f"{r.name:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.message}")
        for r in self.results:
            if not r.passed and r.hint:
                lines.append(f"{r.name}: try: {r.hint}")
        verdict = "all gates passed" if self.passed else f"FAILED: {', '.join(self.failed)}"
        lines.append(f"{verdict} ({len(self.results)} gates, {self.seconds:.1f} s)")
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        _write(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    def junit_xml(self) -> str:
        """JUnit XML: one ``<testsuite>``, one ``<testcase>`` per gate, ``<failure>`` on failed gates."""
        suite = ET.Element("testsuite", name=JUNIT_SUITE, tests=str(len(self.results)),
                           failures=str(len(self.failed)), errors="0", skipped="0", time=f"{self.seconds:.3f}")
        for r in self.results:
            case = ET.SubElement(suite, "testcase", classname=JUNIT_SUITE, name=r.name, time="0")
            details = json.dumps(_jsonable({"measured": r.measured, "threshold": r.threshold}), sort_keys=True)
            if r.passed:
                ET.SubElement(case, "system-out").text = f"{r.message}\n{details}"
            else:
                failure = ET.SubElement(case, "failure", message=r.message, type="GateFailed")
                failure.text = f"{r.message}\ntry: {r.hint}\n{details}"
        root = ET.Element("testsuites", name=JUNIT_SUITE, tests=suite.get("tests"), failures=suite.get("failures"))
        root.append(suite)
        ET.indent(root)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def write_junit(self, path: str) -> None:
        _write(path, self.junit_xml())


def _refuse_non_regular(path: str) -> None:
    """OSError when something other than a regular file is at ``path``: a symbolic link, a device, a
    FIFO, a socket. The report is written by atomic rename, which would replace it (a link would not
    be written through either); a report path is a file of the caller's, nothing else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    if not stat.S_ISREG(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise OSError(errno.EEXIST, f"{what} is there; refusing to replace it (remove it or choose another path)")


def _create_new(path: str):
    """A new file at ``path`` opened for writing: never an existing one, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "w")


def check_report_path(path: str, flag: str) -> None:
    """Prove a report can be written at ``path`` before any step runs: nothing but a regular file is
    there (:func:`_refuse_non_regular`), its folder is created and a temporary file made and removed
    there, as :func:`_write` will. ValueError naming ``flag`` if not."""
    try:
        _refuse_non_regular(path)
        d = os.path.dirname(os.path.abspath(path))
        existing = d
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is not a directory")
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with _create_new(tmp):
            pass
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write the report there ({exc.strerror or exc})") from None


def _write(path: str, text: str) -> None:
    """Write whole or not at all (a CI reader never sees half a report); OSError, and nothing
    replaced, when something other than a regular file is at ``path``."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    _refuse_non_regular(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)  # a leftover of this process id (never followed: unlink removes a link itself)
    except FileNotFoundError:
        pass
    with _create_new(tmp) as f:
        f.write(text)
    try:
        _refuse_non_regular(path)  # again: the path may have changed while the report was written
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def logprob_differences(record) -> tuple[list[float], list[int]]:
    """The first step's per-token ``log_probs - rollout_log_probs`` (train minus rollout, float64) over the
    loss-masked response tokens of every sample, in sample order, and where each sample's tokens start.
    Samples without either log-prob are left out (the ``logprob_abs_diff`` gate reports them)."""
    diffs, starts = [], []
    for s in record.samples:
        rollout = s.rollout_log_probs_tensor()
        if s.log_probs is None or rollout is None:
            continue
        mask = s.loss_mask_tensor() > 0
        starts.append(len(diffs))
        diffs += (s.log_probs.double() - rollout.double())[mask].tolist()
    return diffs, starts


def write_logprob_png(record, report: GateReport, path: str) -> None:
    """A small picture of :func:`logprob_differences`: one point per loss token, a flat line at 0 when the
    trainer recomputes the rollout's log-probs bit for bit (``--true-on-policy-mode``), the threshold band
    otherwise; the title holds the gate's verdict and the largest difference."""
    from rlperf.plots import new_figure, save_png

    diffs, starts = logprob_differences(record)
    gate = next((r for r in report.results if r.name == "logprob_abs_diff"), None)
    fig = new_figure(8, 3)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(len(diffs)), diffs, color="C0", marker=".", markersize=2, linewidth=0.8, zorder=2)
    for x in starts[1:]:
        ax.axvline(x - 0.5, color="grey", linewidth=0.3, alpha=0.5)  # sample boundaries
    limit = gate.threshold if gate is not None and isinstance(gate.threshold, (int, float)) else None
    if limit:
        ax.axhspan(-limit, limit, color="C2", alpha=0.12, label=f"|diff| <= {limit:g} (threshold)")
        ax.legend(fontsize=7, loc="upper right")
    ax.axhline(0.0, color="black", linewidth=0.6, zorder=1)  # under the differences' line
    worst = max((abs(d) for d in diffs), default=0.0)
    verdict = "no gate" if gate is None else "PASS" if gate.passed else "FAIL"
    ax.set_title(f"logprob_abs_diff {verdict}: train - rollout log-prob per loss token "
                 f"({len(diffs)} tokens, {len(starts)} samples, max |diff| "
                 f"{'0: bit-identical' if worst == 0.0 else f'{worst:.3g}'})", fontsize=9)
    ax.set_xlabel("loss token (samples in order; grey lines: sample boundaries)", fontsize=8)
    ax.set_ylabel("train - rollout", fontsize=8)
    if worst == 0.0:
        ax.set_ylim(-1e-6, 1e-6)  # every difference is exactly 0: a flat line on a visible axis
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)
