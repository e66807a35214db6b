"""rlperf.plots — pictures of rlperf's own files, drawn with matplotlib (headless, the Agg canvas).

* :mod:`~rlperf.plots.runs` — :func:`write_run_plot`: reward, KL and log-prob gap, response length,
  tokens/s, peak memory and the step split of one or several ``rlperf train`` runs (``metrics.jsonl``);
* :mod:`~rlperf.plots.bench` — :func:`write_bench_plot`: each benchmark case's ratio to its anchor
  (``rlperf bench``'s JSON), with its target;
* :mod:`~rlperf.plots.command` — ``rlperf plot PATH...``.

Imports nothing of rlperf (it reads files, not objects), so any layer may draw: the loop's ``--plot``
(:class:`rlperf.telemetry.loggers.PlotLogger`), the gate's log-prob picture and the CLI. matplotlib is an
optional dependency (``pip install 'rlperf[plot]'``), imported only when a picture is drawn.
"""
from .common import PlotInputError, new_figure, save_png, write_html
from .runs import METRICS_FILE, read_metrics, write_run_plot

__all__ = ["PlotInputError", "new_figure", "save_png", "write_html", "METRICS_FILE", "read_metrics", "write_run_plot"]
