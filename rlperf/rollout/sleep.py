"""``--rollout-function-path rlperf.rollout.sleep``: a rollout that generates nothing, forever.

The training loop calls its rollout function as ``fn(args, rollout_id, data_source,
evaluation=False)`` (slime's signature). This one never returns: it sends no requests, so the
rollout engines stay loaded and idle behind the router while ``rlperf profile`` starts, loads and
stops them by hand. It logs one line when it starts and one per hour asleep, so a log that stops
growing means the process died, not that it is sleeping.

``args.sleep_rollout_max_hours`` (optional; None = forever) ends it after that many log intervals,
returning an empty sample list; tests use it with a short ``LOG_INTERVAL_S``.
"""
from __future__ import annotations

import logging
import sys
import time
import types

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 3600.0
"""Seconds between "still asleep" log lines (an hour)."""


def sleep(args, rollout_id: int, data_source, evaluation: bool = False) -> list:
    """Keep the engines up and idle; never returns unless ``args.sleep_rollout_max_hours`` is set.

    Parameters follow slime's rollout functions: ``args`` (the run's namespace), ``rollout_id`` (the
    rollout step), ``data_source`` (unused: nothing is sampled), ``evaluation`` (unused).
    Returns an empty list of samples when it does return.
    """
    limit = getattr(args, "sleep_rollout_max_hours", None)
    kind = "evaluation" if evaluation else "rollout"
    logger.info("sleep rollout: %s %s generates nothing; the engines stay up and idle for profiling "
                "(rlperf profile --router-url ...)", kind, rollout_id)
    hours = 0
    while limit is None or hours < limit:
        time.sleep(LOG_INTERVAL_S)
        hours += 1
        logger.info("sleep rollout: %s %s asleep for %d hour%s", kind, rollout_id, hours, "" if hours == 1 else "s")
    return []


class _CallableModule(types.ModuleType):
    """``--rollout-function-path rlperf.rollout.sleep`` names this module, and slime-style loaders
    import ``rlperf.rollout`` and take its attribute ``sleep``, which is this module: calling the
    module calls :func:`sleep`, so both that path and ``rlperf.rollout.sleep.sleep`` work."""

    def __call__(self, args, rollout_id, data_source, evaluation=False):
        return sleep(args, rollout_id, data_source, evaluation)


sys.modules[__name__].__class__ = _CallableModule
