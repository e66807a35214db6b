"""The legal values of the sampling parameters, in the kernels' types: one check for the server's
``sampling_params`` (:meth:`rlperf.rollout.engine.SamplingParams.from_dict`) and ``rlperf train``'s
``--rollout-temperature/--rollout-top-p/--rollout-top-k`` (:func:`rlperf.loop.args.resolve_args`).

:func:`rlperf.kernels.sample` takes temperature and top_p as float32 and top_k as an integer, so a
value is legal when it stays legal *after* that conversion:

* ``temperature``: finite as a float32 (``1e300`` is ``inf`` there) and >= 0 (0: greedy);
  ``positive=True`` (the trainer divides logits by it) also refuses what rounds to 0;
* ``top_p``: in (0, 1], and > 0 as a float32 (``1e-50`` rounds to 0);
* ``top_k``: an integer in [-1, 2**31 - 1] (-1 and 0 disable it, as in SGLang).
"""
from __future__ import annotations

import math
import numbers

import torch

TOP_K_MAX = 2 ** 31 - 1


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
