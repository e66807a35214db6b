"""receive_exact (issue #39, 5): a broadcast is taken only when every announced byte was written, told
by the guard page's presence, never by its content. A stand-in group writes the first ``sent`` bytes
as gloo does for a message of that length; the real gloo path is in
tests/rollout/test_weight_update_hostile.py."""
import pytest
import torch

from rlperf.sync.exact_receive import PAGE, ShortBroadcast, pagemap_works, receive_exact

pytestmark = pytest.mark.skipif(not pagemap_works(), reason="needs /proc/self/pagemap (Linux)")


class _Group:
    def __init__(self, data: torch.Tensor):
        self.data = data

    def broadcast(self, tensor):
        assert len(self.data) <= tensor.numel()  # gloo aborts on a longer message
        tensor[:len(self.data)].copy_(self.data)

    def wait(self, work, *, host):
        pass


@pytest.mark.parametrize("nbytes", [1, 17, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, (1 << 20) + 7])
def test_whole_broadcasts_arrive_and_any_shortfall_is_refused(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    dest = torch.full((nbytes,), 5, dtype=torch.uint8)
    data[-1] = 5  # a whole message may end in what the buffer held: no content check could tell
    receive_exact(_Group(data), dest)
    assert torch.equal(dest, data)
    for short in sorted({1, 8, 16, PAGE - 1, PAGE + 3, nbytes} & set(range(1, nbytes + 1))):
        dest = torch.full((nbytes,), 5, dtype=torch.uint8)
        with pytest.raises(ShortBroadcast, match=f"a broadcast of {nbytes} announced bytes arrived short: at most"):
            receive_exact(_Group(data[:nbytes - short].clone()), dest)
        assert torch.equal(dest, torch.full((nbytes,), 5, dtype=torch.uint8))  # untouched


def test_an_empty_range_is_one_empty_broadcast():
    dest = torch.empty(0, dtype=torch.uint8)
    receive_exact(_Group(torch.empty(0, dtype=torch.uint8)), dest)
