"""Rule rewards and ``--custom-rm-path``.

A reward function takes ``(args, sample)`` — slime's signature for ``--custom-rm-path``; ``sample``
is a :class:`rlperf.train.Sample` with ``prompt``, ``response`` (text), ``label``, ``metadata``,
``tokens``, ``response_length`` and ``status`` filled — and returns a float.

Built-ins (``--rm-type``):

* ``exact`` (the embedded task): 1.0 when the response, stripped of whitespace, equals the label;
* ``boxed_math``: 1.0 when the last ``\\boxed{...}`` of the response (balanced braces) equals the
  label after normalization (spaces dropped, ``$`` stripped, a trailing ``.0`` of an integer
  dropped); 0.0 otherwise, including when there is no ``\\boxed{}``.
"""
from __future__ import annotations

import importlib


def exact_match_reward(args, sample) -> float:
    return float(sample.label is not None and sample.response.strip() == str(sample.label).strip())


def boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth, out = start + len("\\boxed{"), 1, []
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return "".join(out)
        out.append(c)
        i += 1
    return None  # unbalanced: no answer


def _normalize(ans: str) -> str:
    s = ans.replace(" ", "").strip("$")
    if s.endswith(".0") and s[:-2].lstrip("-").isdigit():
        s = s[:-2]
    return s


def boxed_math_reward(args, sample) -> float:
    ans = boxed_answer(sample.response)
    return float(ans is not None and sample.label is not None and _normalize(ans) == _normalize(str(sample.label)))


BUILTIN_REWARDS = {"exact": exact_match_reward, "boxed_math": boxed_math_reward}


def load_python_path(path: str, flag: str):
    """The object named by ``module.attr`` (or a module that is itself callable); ValueError naming ``flag``."""
    try:
        return _load(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{flag} {path!r} cannot be loaded: {exc}") from None


def _load(path: str):
    try:
        obj = importlib.import_module(path)
        if callable(obj):
            return obj
    except ImportError:
        obj = None
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError("expected a dotted path module.function")
    obj = getattr(importlib.import_module(module), attr)
    if not callable(obj):
        raise ValueError(f"{path} is not callable")
    return obj


def reward_fn_for(rm_type: str, custom_rm_path: str | None = None):
    """The reward function of a run: ``--custom-rm-path`` when given, else the built-in ``rm_type``."""
    if custom_rm_path:
        return load_python_path(custom_rm_path, "--custom-rm-path")
    try:
        return BUILTIN_REWARDS[rm_type]
    except KeyError:
        raise ValueError(f"--rm-type {rm_type!r} is not built in; choose from {sorted(BUILTIN_REWARDS)} "
                         f"or give --custom-rm-path") from None
