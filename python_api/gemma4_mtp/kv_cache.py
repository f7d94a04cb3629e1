"""Paged K/V cache of one attention type, as engines keep it (SPEC §5).

All layers of one type (sliding or full) share a block size, a block allocator and one block table
per request, so the drafter can read any of them with that table. Block-table entries of blocks
that slid out of a sliding window are released and set to -1: the ops must never read them.
"""
from __future__ import annotations

import torch

from .transfer import to_device


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"the KV cache has no free block left (num_blocks={self.num_blocks}); "
                                   "load the target with a larger num_blocks")
        return self._free.pop()

    def release(self, block: int) -> None:
        self._free.append(block)


class PagedKVCache:
    """k[i], v[i]: [num_blocks, block_size, num_kv_heads, head_dim] of the i-th layer of this type.

    Unwritten slots hold NaN, so a reader that strays outside the written range poisons its output.
    One more block per layer, `trash` (never allocated, outside k and v), takes the writes of a
    fixed-shape forward's padding nodes, so that a captured forward needs no host-side selection of
    the nodes that exist."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, window: int | None):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # K and V in one allocation, so that a commit moves both with one gather and one scatter
        self.kv_all = torch.full((2, *shape), float("nan"), dtype=dtype, device=device)
        self.k_all, self.v_all = self.kv_all[0], self.kv_all[1]
        self.k, self.v = self.k_all[:, :num_blocks], self.v_all[:, :num_blocks]
        self.trash = num_blocks
        self.block_size = block_size
        self.window = window
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}

    def add_request(self, req: int) -> None:
        self.tables[req] = []

    def remove_request(self, req: int) -> None:
        for b in self.tables.pop(req):
            if b >= 0:
                self.allocator.release(b)

    def reserve(self, req: int, length: int) -> None:
        """Blocks for positions [0, length)."""
        table = self.tables[req]
        while len(table) * self.block_size < length:
            table.append(self.allocator.allocate())

    def trim(self, req: int, length: int, keep_from: int = 0) -> None:
        """Release blocks holding only positions >= length, and (sliding) only positions < keep_from."""
        table = self.tables[req]
        needed = -(-length // self.block_size)
        while len(table) > needed:
            b = table.pop()
            if b >= 0:
                self.allocator.release(b)
        for j in range(min(keep_from // self.block_size, len(table))):
            if table[j] >= 0:
                self.allocator.release(table[j])
                table[j] = -1

    def _host_slots(self, req: int, positions) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset, see _flat) of positions (host integers: a range,
        a list or a CPU tensor) on the host, from the host's block table: nothing is read back from the
        device."""
        if isinstance(positions, range):
            pos = torch.arange(positions.start, positions.stop, positions.step)
        else:
            pos = torch.as_tensor(positions, dtype=torch.long)
        blocks = torch.tensor(self.tables[req], dtype=torch.long)[pos // self.block_size]
        if bool((blocks < 0).any()):
            raise RuntimeError("internal error: access to a released KV block")
        return blocks * self.block_size + pos % self.block_size

    def _slots(self, req: int, positions) -> torch.Tensor:
        """_host_slots on the cache's device."""
        return to_device(self._host_slots(req, positions), self.k.device)

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:
        """[layers, (num_blocks + 1) * block_size, Hkv, D] view of k_all or v_all."""
        return cache.view(cache.shape[0], -1, *cache.shape[3:])

    def write(self, layer: int, req: int, positions, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots(req, positions)
        self._flat(self.k_all)[layer, slots] = k.to(self.k.dtype)
        self._flat(self.v_all)[layer, slots] = v.to(self.v.dtype)

    def read(self, layer: int, req: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots(req, positions)
        return self._flat(self.k_all)[layer, slots], self._flat(self.v_all)[layer, slots]

    def move_slots(self, moves: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
        """The host's [2, n] flat slot ids (sources, destinations) of `moves`, (request, src positions,
        dst positions) each, for `move`."""
        return torch.stack([torch.cat([self._host_slots(r, src) for r, src, _ in moves]),
                            torch.cat([self._host_slots(r, dst) for r, _, dst in moves])])

    def move(self, slots: torch.Tensor) -> None:
        """Copy the K/V of slots[0] to slots[1] ([2, n] on the cache's device, from move_slots) in every
        layer, all gathered first (overlaps are safe): one gather and one scatter for K and V together."""
        flat = self.kv_all.view(2, self.kv_all.shape[1], -1, *self.kv_all.shape[-2:])
        flat[:, :, slots[1]] = flat[:, :, slots[0]]

    def block_table(self, reqs: list[int], device=None) -> torch.Tensor:
        """int32 [len(reqs), max_blocks] on `device` (default the cache's); -1 past each request's blocks
        and for released blocks."""
        width = max([len(self.tables[r]) for r in reqs] + [1])
        out = torch.full((len(reqs), width), -1, dtype=torch.int32)
        for i, r in enumerate(reqs):
            out[i, :len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.int32)
        return to_device(out, self.k.device if device is None else device)
