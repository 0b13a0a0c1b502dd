"""The static KV cache: allocated once for the whole context, written in place, cropped by length."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, [L, Hkv, S, hd] each; `length` is the committed prefix."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.k = torch.zeros(layers, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows [T, Hkv, hd] at positions start..start+T-1 (beyond `length` is scratch until committed)."""
        end = start + keys.shape[0]
        self.k[layer, :, start:end] = keys.transpose(0, 1)
        self.v[layer, :, start:end] = values.transpose(0, 1)

    def keys(self, layer: int, first: int, end: int) -> torch.Tensor:
        return self.k[layer, :, first:end]

    def values(self, layer: int, first: int, end: int) -> torch.Tensor:
        return self.v[layer, :, first:end]

    def crop(self, length: int) -> None:
        """Commit exactly `length` positions; anything written beyond is dead and will be overwritten."""
        assert 0 <= length <= self.capacity, f"crop to {length} outside 0..{self.capacity}"
        self.length = length

    def reset(self) -> None:
        self.length = 0
