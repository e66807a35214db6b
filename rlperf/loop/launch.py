"""Which placement starts the actor ranks: ``--placement local`` or ``ray`` (:func:`placement_for`).

Its own module, above both implementations (:mod:`rlperf.loop.placement`, :mod:`rlperf.loop.ray_placement`),
so that neither imports the other's chooser. Ray itself is imported only when ``--placement ray`` runs.
"""
from __future__ import annotations

import argparse

from .args import PLACEMENTS, UsageError
from .placement import LocalPlacement, Placement
from .ray_placement import RayPlacement


def placement_for(ns: argparse.Namespace) -> Placement:
    """The :class:`rlperf.loop.placement.Placement` that ``--placement`` names."""
    if ns.placement == "local":
        return LocalPlacement()
    if ns.placement == "ray":
        return RayPlacement.from_args(ns)
    raise UsageError(f"--placement {ns.placement}: not available (choose from {', '.join(PLACEMENTS)})")
