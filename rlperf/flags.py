"""Command-line flags, shared by every command: the parser class, its help format, and argparse
``type=`` value checks.

:class:`ArgumentParser` is every ``rlperf`` command's parser: a bad value or a missing argument prints
one line, ``rlperf COMMAND: error: <what> (see rlperf COMMAND --help)``, and exits 2 (the CLI's exit
code of bad usage), without the usage block; its :class:`HelpFormatter` shows each flag's default in
``--help``. Each ``type=`` function takes the flag's text and returns its value, or raises
``argparse.ArgumentTypeError`` with what the flag takes (``argument --flag: <that message>``), so no
bad value reaches a server, an engine or a trainer as a traceback or, worse, silently. Light to
import: nothing of rlperf, torch only where a flag needs it (``--device cuda`` asks whether CUDA is there).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import tempfile
import urllib.parse

MAX_SEED = (1 << 63) - 1
"""The largest seed a flag takes (torch's generators take 64-bit seeds)."""
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*\.?")
_DEVICE = re.compile(r"(auto|cpu|cuda)(:(\d{1,4}))?")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with every flag's default: ``(default: X)`` ends a flag's help unless the help already
    says its default in its own words. Nothing is added where there is nothing to show: a switch off by
    default, a default of None (the help says what its absence means) or an empty list."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (text == argparse.SUPPRESS or default in (None, False, argparse.SUPPRESS) or default == ()
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` for a command whose description is laid out by hand (a table)."""


class ArgumentParser(argparse.ArgumentParser):
    """A command's parser: a usage error is one line naming what is wrong and where the help is, exit 2.

    argparse's own ``error`` prints the whole usage block first (88 lines for ``rlperf train``), which
    buries the line that matters. Subcommand parsers made by :meth:`add_subparsers` are of this class too,
    and take :class:`HelpFormatter` unless told otherwise."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    _COMMAND = "_rlperf_command_parser"
    """Where :meth:`parse_known_args` leaves the innermost (sub)command's parser for :meth:`parse_args`."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if not hasattr(ns, self._COMMAND):  # a subcommand's parser ran first and set itself
            setattr(ns, self._COMMAND, self)
        return ns, extra

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unknown flag is reported by the command it was given to (``rlperf train:
        error: unrecognized arguments: ...``), and the namespace carries no parser (ranks pickle it)."""
        ns, extra = self.parse_known_args(args, namespace)
        command = vars(ns).pop(self._COMMAND, self)
        if extra:
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    t = text.strip()
    if not re.fullmatch(r"[+-]?\d{1,30}", t):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer")
    return int(t)


def int_in(lo: int | None, hi: int | None, what: str | None = None):
    """A ``type=`` for an integer in ``[lo, hi]`` (None: unbounded on that side)."""
    if what is None:
        what = (f"an integer in [{lo}, {hi}]" if lo is not None and hi is not None else
                f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}")

    def check(text: str) -> int:
        v = _int(text)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v
    check.__name__ = "integer"  # argparse names the type in some messages
    return check


positive_int = int_in(1, None, "a positive integer")
positive_int.__doc__ = "A ``type=``: an integer >= 1."
nonnegative_int = int_in(0, None, "an integer >= 0")
nonnegative_int.__doc__ = "A ``type=``: an integer >= 0."
port = int_in(1, 65535, "a TCP port in [1, 65535]")
port.__doc__ = "A ``type=``: a TCP port, 1-65535."
seed = int_in(0, MAX_SEED, "an integer in [0, 2**63 - 1]")
seed.__doc__ = "A ``type=``: a random seed, 0 to 2**63 - 1."


def check_token_buckets(values) -> tuple[int, ...]:
    """``--cuda-graph-buckets``' token counts sorted, duplicates dropped; ValueError naming the flag
    unless there is at least one and each is >= 2 (a sample has at least 2 tokens)."""
    out = tuple(sorted({int(v) for v in values}))
    if not out or out[0] < 2:
        raise ValueError(f"--cuda-graph-buckets takes token counts >= 2, got {list(values)}")
    return out


AUTO_BUCKETS = "auto"
"""``--cuda-graph-buckets auto`` (the default), as parsed: the loop resolves it for its host
(:func:`rlperf.loop.resolve.resolve_cuda_graph_buckets`) before anything reads the buckets."""


def token_buckets(text: str) -> tuple[int, ...] | str:
    """A ``type=``: :data:`AUTO_BUCKETS` (returned as is), ``none`` (``()``: eager) or comma-separated
    token counts (``2048,4096,8192``), :func:`check_token_buckets`."""
    word = text.strip().lower()
    if word == AUTO_BUCKETS:
        return AUTO_BUCKETS
    if word == "none":
        return ()
    takes = "expected auto, none or token counts, comma-separated (e.g. 2048,4096,8192)"
    parts = [t for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: {takes}")
    try:
        return check_token_buckets([_int(t) for t in parts])
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: {takes}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    """A ``type=``: a number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text[:40]}")
    return v


def nonnegative_seconds(text: str) -> float:
    """A ``type=``: a finite number of seconds >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not 0.0 <= v < 1e9:  # nan and inf fail too
        raise argparse.ArgumentTypeError(f"must be a number of seconds in [0, 1e9), got {text[:40]}")
    return v


def positive_seconds(text: str) -> float:
    """A ``type=``: a finite number of seconds > 0."""
    v = nonnegative_seconds(text)
    if v == 0.0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text[:40]}")
    return v


def host(text: str) -> str:
    """A ``type=``: an IPv4 or IPv6 address, or a host name (RFC 1123 labels). Dotted digits must be a
    valid IPv4 address (``999.1.1.1`` is not a name either)."""
    t = text.strip("[]") if text.startswith("[") else text
    if ":" in t or re.fullmatch(r"[\d.]+", t):
        try:
            ipaddress.ip_address(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a valid IP address") from None
        return t
    if not _HOSTNAME.fullmatch(t):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is neither an IP address nor a host name")
    return t


def device_name(text: str) -> str:
    """A ``type=``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, whether or not this machine has it (a
    Ray driver names the device of the cluster's GPU bundles, not its own)."""
    m = _DEVICE.fullmatch(text)
    if not m or (m.group(2) and m.group(1) != "cuda"):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text[:40]!r}")
    return text


def device(text: str) -> str:
    """A ``type=``: :func:`device_name`, and a CUDA device must exist here (a server runs where it is started)."""
    m = _DEVICE.fullmatch(device_name(text))
    if m.group(1) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device (torch sees none); use cpu or auto")
        index = int(m.group(3) or 0)
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def http_url(text: str) -> str:
    """A ``type=``: an ``http://`` or ``https://`` URL with a host (and a valid port, if any)."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, e.g. "
                                         f"http://127.0.0.1:30000, got {text[:80]!r}")
    return text


def writable_dir(text: str) -> str:
    """A ``type=``: a directory this process can write files in, created if missing."""
    path = os.path.abspath(text)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: not a directory this process can write in "
                                         f"({exc.strerror or exc})") from None
    return text
