"""SGLang's ``Qwen3MoeForCausalLM`` on rlperf's kernels: the dense class's forward, whose layers are
rlperf's sparse expert blocks where the config makes them sparse (batch-invariant top-k routing with the
lower expert index winning ties, grouped GEMM whose bits for a token do not depend on its expert's load,
fixed-order combine: :mod:`rlperf.model.moe`)."""
from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``Qwen3MoeForCausalLM`` (``config.json``'s ``architectures``); everything as :class:`Qwen3ForCausalLM`."""


EntryClass = Qwen3MoeForCausalLM
