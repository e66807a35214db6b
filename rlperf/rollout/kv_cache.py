"""The paged KV cache of the rollout engine: per-layer page pools and a page allocator.

Layout (what :func:`rlperf.kernels.paged_attention` reads): per layer a pair ``(k_cache,
v_cache)``, each ``[num_pages, PAGE_SIZE, Hkv, D]`` in the model's dtype. Token ``p`` of a request
lives in slot ``pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE``.

Sizing: ``bytes_per_token = 2 (K and V) * layers * Hkv * D * itemsize``. On CUDA the pool takes
``mem_fraction_static * total_memory - memory already allocated`` (weights and activations live in
the rest, as in SGLang); on CPU, or when ``max_total_tokens`` is given, it holds that many tokens
(rounded up to whole pages). The pool starts zeroed; ``poison=True`` fills it with NaN instead, so
a read of a slot nobody wrote shows up (tests of the invariant path; the fast path's decode
attention reads whole pages under a mask, and a masked NaN still poisons SDPA's output).
"""
from __future__ import annotations

import torch

from rlperf import kernels as K
from rlperf.model import ModelConfig

DEFAULT_CPU_KV_BYTES = 64 << 20  # the CPU pool when neither max_total_tokens nor a GPU is given


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def plan_num_pages(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, max_total_tokens: int | None = None,
                   mem_fraction_static: float | None = None, cpu_bytes: int = DEFAULT_CPU_KV_BYTES) -> int:
    """Number of KV pages for the pool (module docstring); at least one."""
    per_page = bytes_per_token(cfg, dtype) * K.PAGE_SIZE
    if max_total_tokens is not None:
        if max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be positive, got {max_total_tokens}")
        return -(-max_total_tokens // K.PAGE_SIZE)
    if device.type == "cuda":
        frac = 0.85 if mem_fraction_static is None else mem_fraction_static
        if not 0 < frac < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac}")
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * frac) - torch.cuda.memory_allocated(device)
        if budget < per_page:
            raise ValueError(f"mem_fraction_static={frac}: {budget} bytes left for the KV cache after the weights, "
                             f"less than one page ({per_page} bytes)")
        return budget // per_page
    return max(1, cpu_bytes // per_page)


class PagedKVCache:
    """Per-layer K/V page pools plus a free list of page ids (LIFO: recently freed pages are reused first)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, dtype: torch.dtype, device, poison: bool = False):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.cfg, self.num_pages, self.page_size = cfg, num_pages, K.PAGE_SIZE
        shape = (num_pages, K.PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self._fill = fill = float("nan") if poison else 0.0
        self.layers = [(torch.full(shape, fill, dtype=dtype, device=device),
                        torch.full(shape, fill, dtype=dtype, device=device))
                       for _ in range(cfg.num_hidden_layers)]
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def max_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K and V page pools of every layer (allocated once, at construction)."""
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` free page ids; raises RuntimeError when fewer are free (callers check first)."""
        if n > len(self._free):
            raise RuntimeError(f"KV cache: asked for {n} pages, {len(self._free)} free")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def reset(self) -> None:
        """Every page free again (flush); contents are left as they are and overwritten before use."""
        self._free = list(range(self.num_pages - 1, -1, -1))

    def reset_contents(self) -> None:
        """Every page free and filled as at construction (zeros, or NaN when poisoned): the pool a new
        cache would have (the engine's warm-up leaves nothing behind)."""
        for k, v in self.layers:
            k.fill_(self._fill)
            v.fill_(self._fill)
        self.reset()
