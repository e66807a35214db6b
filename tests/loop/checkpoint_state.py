"""What a saved checkpoint holds, for the checkpoint tests' bit-for-bit comparisons."""
import torch

from rlperf.loop import checkpoint as ckpt
from rlperf.model.qwen3 import Qwen3ForCausalLM


def saved_state(save):
    """(HF-named model tensors, trainer state) of the checkpoint ``save``'s pointer names."""
    d = ckpt.checkpoint_dir(save)
    return (Qwen3ForCausalLM.from_pretrained(d / "model").hf_state_dict(),
            torch.load(d / "trainer.pt", weights_only=True))


def bit_equal(a, b) -> bool:
    """``a`` and ``b`` equal bit for bit (tensors of one dtype), through nested dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b))
    return a == b
