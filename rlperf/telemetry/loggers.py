"""Metrics loggers: each rollout's ``metrics.jsonl`` line, also sent to TensorBoard and Weights & Biases.

The loop writes one dict per rollout to ``OUTPUT_DIR/metrics.jsonl`` (slime's names: ``rollout/raw_reward``,
``train/ppo_kl``, ``train/train_rollout_logprob_abs_diff``, ``perf/step_time``, ...). Right after that line
it hands the very same dict to a :class:`MetricsLogger` with ``step = rollout_id``; the dashboards therefore
show the same names at the same steps as the file. Only numbers are logged (:func:`scalar_metrics`: ints and
floats, not bools; ``rollout_id`` is the step itself); strings such as ``memory/kind`` or
``sync/weights_checksum`` stay in the file. Rank 0 alone logs (:func:`open_loggers` gives the other ranks
a logger that does nothing), as rank 0 alone writes the file.

Flags (:func:`add_logger_arguments`, slime's names where slime has them):

* ``--use-tensorboard``: event files under ``--tensorboard-dir`` (default ``OUTPUT_DIR/tensorboard``),
  written with ``torch.utils.tensorboard.SummaryWriter`` and flushed after every rollout;
* ``--use-wandb`` with ``--wandb-project``, ``--wandb-group``, ``--wandb-run-name``, ``--wandb-mode``
  (``online``, or ``offline``: a local run directory under ``--wandb-dir``/wandb/ that ``wandb sync``
  uploads later) and the API key from ``--wandb-key-file`` or the environment's ``WANDB_API_KEY``:
  never from the command line, where every user of the host can read it (``--wandb-key`` is refused
  with that reason);
* ``--plot``: redraw ``OUTPUT_DIR/plot.png`` (and ``plot.html``) at every checkpoint and after the last
  rollout, so a long run can be watched without a dashboard (:mod:`rlperf.plots`).

:func:`logger_config_from` reads these flags once into a frozen :class:`LoggerConfig` and checks that
the packages are installed: a missing one is a usage error naming the pip command.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Protocol

STEP_KEY = "rollout_id"
"""The metrics line's own step: the loggers log every other number at this step."""
TENSORBOARD_SUBDIR = "tensorboard"
PLOT_FILE = "plot.png"
WANDB_KEY_ENV = "WANDB_API_KEY"
WANDB_MODES = ("online", "offline")
PIP_EXTRAS = {"tensorboard": "pip install 'rlperf[tensorboard]' (or: pip install tensorboard)",
              "wandb": "pip install 'rlperf[wandb]' (or: pip install wandb)",
              "matplotlib": "pip install 'rlperf[plot]' (or: pip install matplotlib)"}
"""The pip command that installs each optional package, for the usage errors."""


class MetricsLogger(Protocol):
    """Where one run's metrics go besides ``metrics.jsonl``."""

    def log(self, metrics: dict, step: int) -> None:
        """``metrics``: the rollout's metrics line as written to the file; ``step``: its ``rollout_id``."""

    def checkpoint(self, iteration: int) -> None:
        """The loop saved the checkpoint of ``iteration`` (rollouts ``0 .. iteration-1`` are logged)."""

    def close(self) -> None:
        """The run ended (also after an exception): flush and release files."""


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics line (ints and floats, not bools), without :data:`STEP_KEY`."""
    return {k: v for k, v in metrics.items()
            if k != STEP_KEY and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLogger:
    """Scalars into TensorBoard event files under ``log_dir`` (one ``add_scalar`` per metric and step)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for name, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a running TensorBoard sees each rollout as it lands

    def checkpoint(self, iteration: int) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars into one Weights & Biases run (``wandb.init`` at construction, ``run.log(..., step=step)``).

    ``mode="offline"`` never touches the network: the run is written under ``directory``/wandb/ and
    ``wandb sync DIR`` uploads it later. ``api_key``: None uses wandb's own login (``WANDB_API_KEY``,
    ``~/.netrc``)."""

    def __init__(self, project: str, group: str | None = None, name: str | None = None, mode: str = "online",
                 directory: str | Path = ".", api_key: str | None = None, config: dict | None = None):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", **({"api_key": api_key} if api_key else {}))
        self.run = wandb.init(project=project, group=group, name=name, mode=mode, dir=str(directory),
                              config=dict(config or {}), settings=settings)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(scalar_metrics(metrics), step=step)

    def checkpoint(self, iteration: int) -> None:
        pass  # wandb streams each log call; nothing to flush at a checkpoint

    def close(self) -> None:
        self.run.finish()


class PlotLogger:
    """Redraws the run's picture (:func:`rlperf.plots.write_run_plot` on ``output_dir``) at every checkpoint
    and at the end, from ``metrics.jsonl`` as written so far. A picture that cannot be drawn is a warning
    on stderr, not the end of the run: the metrics file is the record, the picture a view of it."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.drawn_through: int | None = None
        self.last_step: int | None = None

    def draw(self) -> None:
        from rlperf.plots import write_run_plot

        try:
            write_run_plot([self.output_dir], self.output_dir / PLOT_FILE)
        except Exception as exc:  # noqa: BLE001 -- see the class docstring
            print(f"rlperf train: --plot: could not draw {self.output_dir / PLOT_FILE}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        self.drawn_through = self.last_step

    def log(self, metrics: dict, step: int) -> None:
        self.last_step = step

    def checkpoint(self, iteration: int) -> None:
        self.draw()

    def close(self) -> None:
        if self.last_step is not None and self.drawn_through != self.last_step:
            self.draw()


class FanOut:
    """Every logger of a run as one :class:`MetricsLogger`; none at all is a logger that does nothing.
    ``close`` closes them all, even when one of them raises (the first error is re-raised after)."""

    def __init__(self, loggers: list | tuple = ()):
        self.loggers = list(loggers)

    def log(self, metrics: dict, step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def checkpoint(self, iteration: int) -> None:
        for lg in self.loggers:
            lg.checkpoint(iteration)

    def close(self) -> None:
        error = None
        for lg in self.loggers:
            try:
                lg.close()
            except Exception as exc:  # noqa: BLE001 -- the others still close
                error = error or exc
        self.loggers = []
        if error is not None:
            raise error


# ---- flags and configuration --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoggerConfig:
    """Where a run's metrics go besides ``metrics.jsonl`` (:func:`logger_config_from` builds it)."""

    tensorboard_dir: Path | None = None
    """``--use-tensorboard``: the event files' directory; None: no TensorBoard."""
    wandb: WandbConfig | None = None
    """``--use-wandb``: the run to log into; None: no W&B."""
    plot_dir: Path | None = None
    """``--plot``: the run directory whose ``plot.png`` is redrawn at each checkpoint; None: no picture."""


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str
    group: str | None
    name: str | None
    mode: str
    """``online`` or ``offline`` (:data:`WANDB_MODES`)."""
    directory: Path
    """wandb writes its run directory under ``directory/wandb/``."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """From ``--wandb-key-file`` (None: wandb's own login, e.g. ``WANDB_API_KEY``). Never printed."""
    config: dict = dataclasses.field(default_factory=dict, repr=False)
    """The run's flags, shown as the W&B run's config."""


def add_logger_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metrics loggers (metrics.jsonl always; these in addition, rank 0)")
    g.add_argument("--use-tensorboard", action="store_true",
                   help="also write each rollout's metrics as TensorBoard scalars (same names and steps as metrics.jsonl)")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help=f"event file directory (default: OUTPUT_DIR/{TENSORBOARD_SUBDIR})")
    g.add_argument("--use-wandb", action="store_true", help="also log each rollout's metrics to Weights & Biases")
    g.add_argument("--wandb-project", default="rlperf", help="W&B project (default: %(default)s)")
    g.add_argument("--wandb-group", default=None, help="W&B group (runs to compare side by side)")
    g.add_argument("--wandb-run-name", default=None, help="W&B run name (default: wandb's)")
    g.add_argument("--wandb-mode", default="online", choices=WANDB_MODES,
                   help="online, or offline: a local run directory under --wandb-dir/wandb/ that `wandb sync` uploads")
    g.add_argument("--wandb-dir", default=None, metavar="DIR", help="where wandb writes its files (default: OUTPUT_DIR)")
    g.add_argument("--wandb-key-file", default=None, metavar="PATH",
                   help=f"file holding the W&B API key (default: the environment's {WANDB_KEY_ENV} or wandb's login)")
    g.add_argument("--wandb-key", default=None, help=argparse.SUPPRESS)  # refused: see logger_config_from
    g.add_argument("--plot", action="store_true",
                   help=f"redraw OUTPUT_DIR/{PLOT_FILE} and plot.html at every checkpoint and after the last rollout "
                        f"(rlperf plot OUTPUT_DIR draws the same picture any time)")


def logger_config_from(ns: argparse.Namespace, error: type[Exception] = ValueError) -> LoggerConfig:
    """The :class:`LoggerConfig` of ``ns`` (``ns.output_dir`` and the flags of :func:`add_logger_arguments`).

    Raises ``error`` naming the flag for a key given on the command line, an unreadable or empty
    ``--wandb-key-file``, and a package that is not installed (with its pip command)."""
    out = Path(ns.output_dir)
    if getattr(ns, "wandb_key", None) is not None:
        raise error(f"--wandb-key: an API key on the command line is visible to every user of this host (ps, shell "
                    f"history); put it in a file for --wandb-key-file or in the environment's {WANDB_KEY_ENV}")
    tensorboard_dir = None
    if getattr(ns, "use_tensorboard", False):
        _require("tensorboard", "--use-tensorboard", error)
        tensorboard_dir = Path(ns.tensorboard_dir) if ns.tensorboard_dir else out / TENSORBOARD_SUBDIR
    elif getattr(ns, "tensorboard_dir", None):
        raise error("--tensorboard-dir needs --use-tensorboard")
    wandb = None
    if getattr(ns, "use_wandb", False):
        _require("wandb", "--use-wandb", error)
        api_key = None
        if ns.wandb_key_file:
            try:
                api_key = Path(ns.wandb_key_file).read_text().strip()
            except OSError as exc:
                raise error(f"--wandb-key-file {ns.wandb_key_file}: {exc.strerror or exc}") from None
            if not api_key:
                raise error(f"--wandb-key-file {ns.wandb_key_file}: the file is empty")
        elif ns.wandb_mode == "online" and not os.environ.get(WANDB_KEY_ENV) and not _has_netrc_login():
            raise error(f"--use-wandb --wandb-mode online needs an API key: --wandb-key-file PATH or the environment's "
                        f"{WANDB_KEY_ENV} (or `wandb login`); --wandb-mode offline needs none")
        wandb = WandbConfig(project=ns.wandb_project, group=ns.wandb_group, name=ns.wandb_run_name, mode=ns.wandb_mode,
                            directory=Path(ns.wandb_dir) if ns.wandb_dir else out, api_key=api_key,
                            config=_flag_values(ns))
    plot_dir = None
    if getattr(ns, "plot", False):
        _require("matplotlib", "--plot", error)
        plot_dir = out
    return LoggerConfig(tensorboard_dir=tensorboard_dir, wandb=wandb, plot_dir=plot_dir)


def open_loggers(config: LoggerConfig | None, rank: int = 0) -> FanOut:
    """The loggers ``config`` asks for, opened (rank 0; any other rank gets an empty :class:`FanOut`)."""
    if config is None or rank != 0:
        return FanOut()
    loggers = []
    try:
        if config.tensorboard_dir is not None:
            loggers.append(TensorBoardLogger(config.tensorboard_dir))
        if config.wandb is not None:
            w = config.wandb
            loggers.append(WandbLogger(w.project, w.group, w.name, w.mode, w.directory, w.api_key, w.config))
        if config.plot_dir is not None:
            loggers.append(PlotLogger(config.plot_dir))
    except BaseException:
        FanOut(loggers).close()
        raise
    return FanOut(loggers)


def package_installed(name: str) -> bool:
    """Whether ``name`` can be imported (checked before the run, so a missing one is a usage error)."""
    return importlib.util.find_spec(name) is not None


def _require(package: str, flag: str, error: type[Exception]) -> None:
    if not package_installed(package):
        raise error(f"{flag} needs the {package} package, which is not installed: {PIP_EXTRAS[package]}")


def _has_netrc_login() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _flag_values(ns: argparse.Namespace) -> dict:
    """The flags of ``ns`` whose values are plain (str, number, bool, None, lists of those): the W&B config.
    Secrets never go there (keys, key files' contents are not flags' values)."""
    plain = (str, int, float, bool, type(None))
    out = {}
    for k, v in sorted(vars(ns).items()):
        if "key" in k or "token" in k or "secret" in k:
            continue
        if isinstance(v, plain) and not (isinstance(v, float) and math.isnan(v)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v):
            out[k] = list(v)
    return out
