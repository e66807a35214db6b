"""The legal values of the sampling parameters, in the kernels' types: one check for the server's
``sampling_params`` (:meth:`rlperf.rollout.engine.SamplingParams.from_dict`) and ``rlperf train``'s
``--rollout-temperature/--rollout-top-p/--rollout-top-k`` (:func:`rlperf.loop.args.resolve_args`).

:func:`rlperf.kernels.sample` takes temperature and top_p as float32 and top_k as an integer, so a
value is legal when it stays legal *after* that conversion:

* ``temperature``: finite as a float32 (``1e300`` is ``inf`` there) and >= 0 (0: greedy);
  ``positive=True`` (the trainer divides logits by it) also refuses what rounds to 0;
* ``top_p``: in (0, 1], and > 0 as a float32 (``1e-50`` rounds to 0);
* ``top_k``: an integer in [-1, 2**31 - 1] (-1 and 0 disable it, as in SGLang).

A request's stop conditions are bounded too (:func:`check_stop_limits`), since the engine pays for
them on every decode step of the request, inside the step every other request shares: at most
:data:`MAX_STOP_STRINGS` stop strings of :data:`MAX_STOP_CHARS` characters in all, and at most
:data:`MAX_STOP_TOKEN_IDS` stop token ids (75,000 stop strings, a 1 MB body, once made 64 tokens take
12.5 s and other clients' requests 20 to 45 times slower).
"""
from __future__ import annotations

import math
import numbers

import torch

TOP_K_MAX = 2 ** 31 - 1

MAX_STOP_STRINGS = 64
"""The most ``stop`` strings one request may carry (each is searched for after every decoded token)."""
MAX_STOP_CHARS = 2048
"""The most characters the ``stop`` strings of one request may hold in all (the longest one sets how
many tokens of the output's tail are decoded after every token)."""
MAX_STOP_TOKEN_IDS = 256
"""The most ``stop_token_ids`` one request may carry."""


def _float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def check_sampling_values(temperature=None, top_p=None, top_k=None, *, names: dict | None = None,
                          positive_temperature: bool = False, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the parameter (``names`` maps ``temperature``/``top_p``/``top_k`` to the
    name the caller's user knows: a flag or a JSON field) for a value the sampling kernel cannot take.
    ``None`` skips a parameter; numbers only (the callers parse their own input types)."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", **(names or {})}
    if temperature is not None:
        t = float(temperature)
        t32 = _float32(t) if math.isfinite(t) else t
        if not math.isfinite(t32) or t32 < 0 or (positive_temperature and t32 <= 0):
            need = "> 0" if positive_temperature else ">= 0 (0: greedy)"
            raise error(f"{names['temperature']} must be finite as a float32 and {need}, got {temperature!r}")
    if top_p is not None:
        p = float(top_p)
        if not (math.isfinite(p) and 0 < p <= 1 and _float32(p) > 0):
            raise error(f"{names['top_p']} must be in (0, 1] (and > 0 as a float32), got {top_p!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not -1 <= top_k <= TOP_K_MAX:
            raise error(f"{names['top_k']} must be an integer in [-1, {TOP_K_MAX}] (-1 or 0: disabled), got {top_k!r}")


def check_stop_limits(stop, stop_token_ids, *, prefix: str = "sampling_params.",
                      error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the field (``prefix`` + ``stop`` / ``stop_token_ids``) and the limit when a
    request carries more stop strings than :data:`MAX_STOP_STRINGS`, more characters of them than
    :data:`MAX_STOP_CHARS`, or more stop token ids than :data:`MAX_STOP_TOKEN_IDS`. Counts only: the
    callers check the types (non-strings count no characters here), so a huge list is refused
    before it is walked element by element."""
    if len(stop) > MAX_STOP_STRINGS:
        raise error(f"{prefix}stop holds {len(stop)} strings, more than the limit of {MAX_STOP_STRINGS}")
    chars = sum(len(s) for s in stop if isinstance(s, str))
    if chars > MAX_STOP_CHARS:
        raise error(f"{prefix}stop holds {chars} characters in all, more than the limit of {MAX_STOP_CHARS}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise error(f"{prefix}stop_token_ids holds {len(stop_token_ids)} ids, more than the limit of "
                    f"{MAX_STOP_TOKEN_IDS}")
