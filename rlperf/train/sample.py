"""One sample from prompt to optimizer step: slime's ``Sample``, with slime's field names.

A rollout function makes one :class:`Sample` per generation and fills what slime's do:
``tokens`` (prompt then response token ids), ``response_length`` R (the response is the last R
tokens), ``response`` (its text), ``rollout_log_probs`` (the engine's log-prob of each response
token), ``status`` (:class:`Sample.Status`, from the engine's finish reason), ``reward``, and
optionally ``loss_mask`` (R entries, 1 = train on this token, 0 e.g. for tool output; None = all
ones). ``group_index``/``index`` place it in its prompt group and in the rollout; ``prompt``,
``label`` and ``metadata`` come from the prompt data (reward functions read them).

Those fields hold plain Python values (lists, as slime's), so custom generate and rollout functions
build a sample with list operations, and a sample saves to JSON as is (:meth:`Sample.to_dict`;
``--save-debug-rollout-data``). The trainer reads them as tensors (:meth:`Sample.token_ids`,
:meth:`Sample.loss_mask_tensor`, :meth:`Sample.rollout_log_probs_tensor`; a field may also hold a
tensor already) and fills in, per response token, ``log_probs`` (old actor), ``ref_log_probs``
(reference model) and ``advantages`` ([R] float32 each; :meth:`rlperf.train.Trainer.prepare`).

A sample is checked when it is packed for training (:meth:`Sample.validate`): ``0 < R < L`` (a
prompt token first: the first response token needs a token before it) and every per-token field
has R entries.
"""
from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Sequence

import torch

# the fields a rollout fills; to_dict/from_dict carry exactly these (the trainer's are recomputed)
_ROLLOUT_FIELDS = ("group_index", "index", "prompt", "tokens", "response", "response_length", "label", "reward",
                   "loss_mask", "rollout_log_probs", "status", "metadata", "rollout_routed_experts")


@dataclasses.dataclass
class Sample:
    """One generation and what training needs of it (module docstring; slime's ``Sample`` fields)."""

    class Status(enum.Enum):
        """Where a sample stands (slime's): ``PENDING`` until generated, then ``COMPLETED`` (a stop),
        ``TRUNCATED`` (the length limit) or ``ABORTED``."""

        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

        @classmethod
        def of_finish_reason(cls, finish_type: str) -> "Sample.Status":
            """SGLang's ``finish_reason.type`` (``stop``, ``length``, ``abort``) as a status."""
            try:
                return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}[finish_type]
            except KeyError:
                raise ValueError(f"unknown finish reason {finish_type!r} (expected stop, length or abort)") from None

    tokens: Sequence[int] | torch.Tensor = dataclasses.field(default_factory=list)
    """Prompt then response token ids, [L]."""
    response_length: int = 0
    """R: the response is ``tokens[L - R:]``."""
    _: dataclasses.KW_ONLY
    group_index: int | None = None
    """The prompt group: samples ``[g * n, (g + 1) * n)`` of a rollout answer prompt ``g``."""
    index: int | None = None
    """Position in the rollout."""
    prompt: str = ""
    response: str = ""
    label: str | None = None
    reward: float = 0.0
    loss_mask: Sequence[int] | torch.Tensor | None = None
    """[R], 1 = train on the token; None = every response token."""
    rollout_log_probs: Sequence[float] | torch.Tensor | None = None
    """[R]: the rollout engine's log-prob of each response token."""
    status: Status = Status.PENDING
    metadata: dict = dataclasses.field(default_factory=dict)
    log_probs: torch.Tensor | None = None
    """[R] float32, the actor before this rollout's updates (:meth:`rlperf.train.Trainer.prepare`)."""
    ref_log_probs: torch.Tensor | None = None
    """[R] float32, the reference model (:meth:`rlperf.train.Trainer.prepare`, when the loss needs it)."""
    advantages: torch.Tensor | None = None
    """[R] float32 (:meth:`rlperf.train.Trainer.prepare`)."""
    rollout_routed_experts: torch.Tensor | None = None
    """MoE models: [L - 1, num MoE layers, k] integers, the experts the rollout engine routed every
    token but the last to (``GenerationResult.routed_experts``, or SGLang's
    ``meta_info["routed_experts"]`` through :func:`rlperf.model.moe.decode_routed_experts`); what
    the trainer replays under rollout routing replay (``make_micro_batch(replay_routing=True)``)."""

    @property
    def total_length(self) -> int:
        """L, prompt plus response tokens."""
        return len(self.tokens)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    # ---- the trainer's views ----------------------------------------------------------------
    def token_ids(self) -> torch.Tensor:
        """``tokens`` as an int64 tensor [L]."""
        return torch.as_tensor(self.tokens, dtype=torch.int64)

    def loss_mask_tensor(self) -> torch.Tensor:
        """``loss_mask`` as a float32 tensor [R] (all ones when None)."""
        if self.loss_mask is None:
            return torch.ones(self.response_length, dtype=torch.float32)
        return torch.as_tensor(self.loss_mask, dtype=torch.float32)

    def rollout_log_probs_tensor(self) -> torch.Tensor | None:
        """``rollout_log_probs`` as a float32 tensor [R], or None."""
        if self.rollout_log_probs is None:
            return None
        return torch.as_tensor(self.rollout_log_probs, dtype=torch.float32)

    def validate(self) -> None:
        """ValueError unless the sample can be trained on (module docstring)."""
        tokens = self.token_ids()
        L, R = tokens.numel(), self.response_length
        if tokens.dim() != 1 or isinstance(R, bool) or not isinstance(R, numbers.Integral) or not 0 < R < L:
            raise ValueError(f"Sample: need tokens [L] with 0 < response_length < L (a prompt token first), "
                             f"got tokens {list(tokens.shape)} and response_length {R!r}")
        for name in ("loss_mask", "rollout_log_probs", "log_probs", "ref_log_probs", "advantages"):
            v = getattr(self, name)
            if v is not None and tuple(torch.as_tensor(v).shape) != (R,):
                raise ValueError(f"Sample: {name} must have shape [{R}] (response_length), "
                                 f"got {list(torch.as_tensor(v).shape)}")

    # ---- plain data (debug rollout data) ---------------------------------------------------
    def to_dict(self) -> dict:
        """The rollout's fields as JSON-ready data (tensors as lists, ``status`` by value); the
        trainer's fields are left out (they are recomputed)."""
        out = {}
        for name in _ROLLOUT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, torch.Tensor):
                v = v.tolist()
            elif isinstance(v, Sample.Status):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            out[name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        """The sample :meth:`to_dict` gave (floats bit for bit, through JSON)."""
        unknown = sorted(set(d) - set(_ROLLOUT_FIELDS))
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown fields {unknown}")
        d = dict(d)
        if "status" in d:
            d["status"] = cls.Status(d["status"])
        if d.get("rollout_routed_experts") is not None:  # MoE routing (routing replay), saved as nested lists
            d["rollout_routed_experts"] = torch.tensor(d["rollout_routed_experts"], dtype=torch.int32)
        return cls(**d)
