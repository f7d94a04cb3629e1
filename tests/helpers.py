"""Shared test inputs and the SPEC §6 tolerance rule. Every op's tests (all backends) use these."""
from __future__ import annotations

import math

import torch

from gemma4_mtp_kernels.drafter_shapes import DRAFTERS  # noqa: F401  (re-exported for the tests)

CACHE_LAYOUTS = ("nhd", "kv_split", "kv_first", "hnd")
# a drafter at small shapes for whole-step tests (gemma4_mtp.drafter.random_drafter): 3 sliding layers and
# a full one of different head dims and KV heads, a window shorter than their contexts
SMALL_DRAFTER = dict(Hb=64, Hd=128, inter=160, Hq=4, Hkv_swa=2, Hkv_full=1, D_swa=64, D_full=128, window=24,
                     vocab=96, centroids=None, top_k=None)


def paged_kv(seq_lens, block_size, Hkv, D, *, dtype=torch.float32, layout="nhd", window=None, spare_blocks=3,
             generator=None, device="cpu"):
    """A paged K/V cache holding random entries for each request, laid out as an engine would.

    layout: "nhd"      k, v are separate [num_blocks, bs, Hkv, D] tensors
            "kv_split" views kv[:, 0], kv[:, 1] of one [num_blocks, 2, bs, Hkv, D] tensor (vLLM Triton)
            "kv_first" views kv[0], kv[1] of one [2, num_blocks, bs, Hkv, D] tensor (FlashAttention)
            "hnd"      permuted views of [num_blocks, Hkv, bs, D] storage
    Blocks are assigned in a random permutation. Unused slots (past seq_len, and spare blocks) hold
    NaN; block-table entries that the call never reads (past the end, and wholly before the window)
    hold garbage ids, so a kernel reading them gives NaN or goes out of bounds.
    Returns (k_cache, v_cache, block_table int32 [B, max_blocks], seq_lens int32 [B]).
    """
    g = generator
    B = len(seq_lens)
    per_req = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    max_blocks = max(per_req) + 1
    num_blocks = sum(per_req) + spare_blocks
    shape = {
        "nhd": (num_blocks, block_size, Hkv, D),
        "kv_split": (num_blocks, 2, block_size, Hkv, D),
        "kv_first": (2, num_blocks, block_size, Hkv, D),
        "hnd": (num_blocks, 2, Hkv, block_size, D),
    }[layout]
    store = torch.full(shape, float("nan"), dtype=dtype, device=device)
    if layout == "nhd":
        k, v = store, torch.full(shape, float("nan"), dtype=dtype, device=device)
    elif layout == "kv_split":
        k, v = store[:, 0], store[:, 1]
    elif layout == "kv_first":
        k, v = store[0], store[1]
    else:
        k, v = store[:, 0].transpose(1, 2), store[:, 1].transpose(1, 2)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.randint(-(10**6), 10**6, (B, max_blocks), generator=g, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        start = max(0, n - window) if window is not None else 0
        for j in range(per_req[b]):
            blk = perm.pop()
            table[b, j] = blk
            lo, hi = j * block_size, min(n, (j + 1) * block_size)
            if hi > lo:
                k[blk, : hi - lo] = torch.randn(hi - lo, Hkv, D, generator=g).to(dtype)
                v[blk, : hi - lo] = torch.randn(hi - lo, Hkv, D, generator=g).to(dtype)
        # blocks wholly before the window: garbage ids (an engine may have freed them)
        for j in range(start // block_size):
            table[b, j] = -(7 + j)
    return k, v, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def poisoned(shape, dtype, device="cpu"):
    """An output buffer full of NaN (or -1 for integers), so unwritten elements show."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def assert_tolerance(actual, exact, same_dtype_ref, *, atol=1e-5, factor=2.0, what=""):
    """SPEC §6: the kernel's error against an fp64/fp32 `exact` result is at most `factor` times the
    error of the reference computed in the kernel's own dtype (`same_dtype_ref`), plus `atol`."""
    exact = exact.double()
    err = (actual.double() - exact).abs()
    ref_err = (same_dtype_ref.double() - exact).abs()
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    ref_worst = ref_err.max().item() if ref_err.numel() else 0.0
    budget = factor * ref_worst + atol
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= budget, f"{what}: max error {worst:.3e} > budget {budget:.3e} (ref error {ref_worst:.3e})"


def held_out_prompts(lengths):
    """Prompts of the given lengths from the embedded model's held-out text (stdlib files its training
    never saw), spread over the stream."""
    from gemma4_mtp import train

    held_out = train.held_out_stream(train.load_tokenizer(train.ASSETS))
    stride = held_out.numel() // len(lengths)
    return [held_out[i * stride:i * stride + n] for i, n in enumerate(lengths)]


def tree_path(parents, node):
    """The nodes from the root's child down to `node` (root excluded): an accepted path to commit."""
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
