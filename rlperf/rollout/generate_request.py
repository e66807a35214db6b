"""The ``/generate`` request model: a decoded JSON body checked and normalised to one entry per prompt
(SGLang's ``GenerateReqInput``); every field error is a :class:`BadRequest` naming the field."""
from __future__ import annotations

import dataclasses

from .engine import BadRequest, SamplingParams


@dataclasses.dataclass
class GenerateRequest:
    """A ``/generate`` body, checked and normalised to one entry per prompt (SGLang's ``GenerateReqInput``).

    Exactly one of ``text`` and ``input_ids`` is set. ``is_batch`` says whether the body was a batch
    (the reply is then a list, or stream chunks carry ``index``). Other fields SGLang clients send
    (``lora_path: null``, ``logprob_start_len``, ``return_text_in_logprobs``, ...) are ignored.
    """

    text: list[str] | None
    input_ids: list[list[int]] | None
    sampling_params: list[SamplingParams]
    return_logprob: list[bool]
    rid: list[str | None]
    stream: bool = False
    is_batch: bool = False
    return_routed_experts: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.sampling_params)

    @classmethod
    def from_json(cls, body: dict) -> "GenerateRequest":
        """Parse a decoded JSON body; :class:`BadRequest` naming the field on anything wrong."""
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of 'text' and 'input_ids'")
        if text is not None:
            if isinstance(text, str):
                batch, text = False, [text]
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                batch, text = True, list(text)
            else:
                raise BadRequest("'text' must be a string or a non-empty list of strings")
            n = len(text)
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
                batch, input_ids = True, [list(p) for p in input_ids]
            elif isinstance(input_ids, list):
                batch, input_ids = False, [list(input_ids)]
            else:
                raise BadRequest("'input_ids' must be a list of token ids or a non-empty list of such lists")
            for p in input_ids:
                if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise BadRequest("'input_ids' must hold non-empty lists of integers")
            n = len(input_ids)

        def per_prompt(key, default, check, what):
            v = body.get(key, default)
            if v is None:
                v = default
            if batch and isinstance(v, list):
                if len(v) != n:
                    raise BadRequest(f"'{key}' has {len(v)} entries for {n} prompts")
                vals = v
            else:
                vals = [v] * n
            for x in vals:
                if not check(x):
                    raise BadRequest(f"'{key}' must be {what}, got {x!r}")
            return vals

        sps = [SamplingParams.from_dict(d) for d in per_prompt("sampling_params", {}, lambda x: isinstance(x, dict), "an object")]
        lps = per_prompt("return_logprob", False, lambda x: isinstance(x, bool), "a boolean")
        routed = per_prompt("return_routed_experts", False, lambda x: isinstance(x, bool), "a boolean")
        rid = body.get("rid")
        if rid is None:
            rids = [None] * n
        elif batch and isinstance(rid, list) and len(rid) == n and all(isinstance(x, str) for x in rid):
            rids = list(rid)
        elif isinstance(rid, str):
            rids = [rid] if not batch else [f"{rid}-{i}" for i in range(n)]
        else:
            raise BadRequest("'rid' must be a string (or a list of strings, one per prompt)")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest(f"'stream' must be a boolean, got {stream!r}")
        return cls(text=text, input_ids=input_ids, sampling_params=sps, return_logprob=lps, rid=rids,
                   stream=bool(stream), is_batch=batch, return_routed_experts=routed)

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids (``text`` encoded with ``tokenizer``)."""
        return self.input_ids if self.input_ids is not None else [tokenizer.encode(t) for t in self.text]
