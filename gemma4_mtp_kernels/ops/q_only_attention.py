"""Public `q_only_paged_attention` (SPEC §4.2): validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve

OP = "q_only_paged_attention"
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)


def q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=1.0, window=None, softcap=None,
                           out=None, return_lse=False, backend="auto"):
    """Q-only attention of drafter queries over a borrowed paged KV cache.

    q [B, Q, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (any strides but stride 1 in D);
    block_table [B, max_blocks] int32; seq_lens [B] int32. Every query of request b attends cache
    entries [max(0, seq_lens[b] - window), seq_lens[b]) with no mask among the Q queries.
    Returns out [B, Q, Hq, D] in q.dtype, and lse [B, Q, Hq] fp32 (natural log) if return_lse.
    """
    C.tensor(OP, "q", q, ndim=4, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "k_cache", k_cache, ndim=4, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "v_cache", v_cache, ndim=4, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "block_table", block_table, ndim=2, dtypes=(torch.int32,))
    C.tensor(OP, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    C.same_dtype(OP, "q", q, [("k_cache", k_cache), ("v_cache", v_cache)])
    C.same_device(OP, "q", q, [("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                               ("seq_lens", seq_lens), ("out", out)])
    B, Qn, Hq, D = q.shape
    if D not in SUPPORTED_HEAD_DIMS:
        C.fail_value(OP, "q", f"of head dim in {SUPPORTED_HEAD_DIMS} (shape[3])", f"head dim {D}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        C.fail_value(OP, "v_cache", f"of the same shape as k_cache {tuple(k_cache.shape)}", f"shape {tuple(v_cache.shape)}")
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if block_size < 1:
        C.fail_value(OP, "k_cache", "a block size >= 1 (shape[1])", f"shape {tuple(k_cache.shape)}")
    C.dim(OP, "k_cache", k_cache, 3, D, "head dim D = q.shape[3]")
    if Hq < 1:
        C.fail_value(OP, "q", "at least one query head (shape[2])", f"shape {tuple(q.shape)}")
    if Hkv < 1 or Hq % Hkv != 0:
        C.fail_value(OP, "k_cache", f"a KV head count dividing Hq = {Hq} (shape[2])", f"Hkv = {Hkv}")
    C.dim(OP, "block_table", block_table, 0, B, "B = q.shape[0]")
    C.dim(OP, "seq_lens", seq_lens, 0, B, "B = q.shape[0]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        C.inner_contiguous(OP, name, t)
    C.contiguous(OP, "seq_lens", seq_lens)
    C.finite_float(OP, "scale", scale)
    if window is not None:
        C.positive_int(OP, "window", window)
    if softcap is not None:
        C.finite_float(OP, "softcap", softcap, positive=True)
    if not isinstance(return_lse, bool):
        C.fail_type(OP, "return_lse", "a bool", return_lse)
    if out is not None:
        C.out_tensor(OP, out, q.shape, q.dtype, q.device)
        C.no_overlap(OP, "out", out, [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                      ("block_table", block_table), ("seq_lens", seq_lens)])
    if C.values_checkable(seq_lens):
        _check_cache_indices(block_table, seq_lens, num_blocks, block_size, window)
    impl = resolve(OP, backend, q.device, q.dtype,
                   {"B": B, "Q": Qn, "Hq": Hq, "Hkv": Hkv, "D": D, "sliding": window is not None})
    return impl(q, k_cache, v_cache, block_table, seq_lens, scale=float(scale), window=window,
                softcap=None if softcap is None else float(softcap), out=out, return_lse=return_lse)


def _check_cache_indices(block_table, seq_lens, num_blocks, block_size, window):
    """seq_lens fit the block table, and the blocks the call will read hold valid block ids.

    Entries outside the attended range are never read and may be garbage (an engine may have freed
    the blocks that slid out of the window)."""
    max_blocks = block_table.shape[1]
    capacity = max_blocks * block_size
    C.index_range(OP, "seq_lens", seq_lens, 0, capacity + 1, f"max_blocks * block_size = {capacity}")
    lens = seq_lens.long()
    starts = lens - window if window is not None else torch.zeros_like(lens)
    first = starts.clamp(min=0) // block_size
    last = (lens + block_size - 1) // block_size  # exclusive
    cols = torch.arange(max_blocks, device=block_table.device)
    read = (cols[None, :] >= first[:, None]) & (cols[None, :] < last[:, None])
    used = block_table[read]
    if used.numel():
        bad = (used < 0) | (used >= num_blocks)
        if bool(bad.any()):
            b, col = (read & ((block_table < 0) | (block_table >= num_blocks))).nonzero()[0].tolist()
            C.fail_value(OP, "block_table", f"block ids in [0, {num_blocks}) for the blocks the call reads",
                         f"block_table[{b}, {col}] = {int(block_table[b, col])}")
