"""Reference q_only_paged_attention (SPEC §4.2) against an independent fp64 computation."""
import math

import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import reference
from helpers import CACHE_LAYOUTS, DRAFTERS, assert_tolerance, paged_kv, poisoned

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def exact(q, k_cache, v_cache, block_table, seq_lens, *, scale=1.0, window=None, softcap=None):
    """fp64 attention, walking the block table position by position; (out, lse) in fp64."""
    B, Qn, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros(B, Qn, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Qn, Hq), -math.inf, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        first = 0 if window is None else max(0, n - window)
        rows = [(int(block_table[b, p // bs]), p % bs) for p in range(first, n)]
        if not rows:
            continue
        k = torch.stack([k_cache[blk, slot] for blk, slot in rows]).double()  # [n, Hkv, D]
        v = torch.stack([v_cache[blk, slot] for blk, slot in rows]).double()
        for h in range(Hq):
            kh, vh = k[:, h // group], v[:, h // group]  # query head h reads KV head h // group
            s = scale * (q[b, :, h].double() @ kh.T)  # [Q, n]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            m = s.max(dim=1, keepdim=True).values
            w = torch.exp(s - m)
            out[b, :, h] = (w @ vh) / w.sum(dim=1, keepdim=True)
            lse[b, :, h] = m.squeeze(1) + torch.log(w.sum(dim=1))
    return out, lse


def make(seq_lens, Qn, Hq, Hkv, D, dtype, *, block_size=16, layout="nhd", window=None, q_scale=1.0):
    k, v, table, lens = paged_kv(seq_lens, block_size, Hkv, D, dtype=dtype, layout=layout, window=window)
    q = (q_scale * torch.randn(len(seq_lens), Qn, Hq, D) / D**0.25).to(dtype)
    k.mul_(D**-0.25)  # keep scores O(1) so the softmax is not one-hot
    return q, k, v, table, lens


def check(result, args, *, scale=1.0, window=None, softcap=None, what=""):
    q = args[0]
    out, lse = result
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    ex_out, ex_lse = exact(*args, scale=scale, window=window, softcap=softcap)
    assert_tolerance(out, ex_out, ex_out.to(q.dtype), atol=2e-5, what=f"{what} out")
    empty = torch.isinf(ex_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{what}: lse must be -inf exactly where seq_len is 0"
    assert (out[empty.nonzero(as_tuple=True)] == 0).all(), f"{what}: output must be 0 where seq_len is 0"
    finite = ~empty
    assert_tolerance(lse[finite], ex_lse[finite], ex_lse[finite].float(), atol=2e-5, what=f"{what} lse")


def run(args, **kw):
    return g.q_only_paged_attention(*args, return_lse=True, backend="torch", **kw)


def drafter_cases():
    for name, d in DRAFTERS.items():
        yield pytest.param(name, d["Hq"], d["Hkv_swa"], d["D_swa"], d["window"], id=f"{name}-sliding")
        yield pytest.param(name, d["Hq"], d["Hkv_full"], d["D_full"], None, id=f"{name}-full")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,Hq,Hkv,D,window", list(drafter_cases()))
def test_real_drafter_shapes(name, Hq, Hkv, D, window, dtype):
    # one request longer than the real window, one shorter, one empty; Q = 2 tree-level queries
    lens = [(window or 600) + 37, 45, 0]
    args = make(lens, 2, Hq, Hkv, D, dtype, block_size=16, window=window)
    check(run(args, window=window), args, window=window, what=f"{name} {dtype}")


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("window", [None, 1, 5, 15, 16, 17, 40, 1000])
def test_layouts_and_windows(layout, window):
    bs = 16
    lens = [0, 1, bs - 1, bs, bs + 1, 3 * bs + 5]
    args = make(lens, 3, 4, 2, 64, torch.float32, block_size=bs, layout=layout, window=window)
    check(run(args, window=window), args, window=window, what=f"{layout} window={window}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_head_dims_and_dtypes(D, dtype):
    args = make([5, 33], 1, 8, 2, D, dtype, block_size=8, layout="kv_split")
    check(run(args), args, what=f"D={D} {dtype}")


def test_reference_module_directly_scale_and_softcap():
    args = make([70, 3, 19], 2, 4, 4, 128, torch.float32, block_size=32, layout="kv_first", q_scale=12.0)
    kw = dict(scale=0.7, softcap=5.0, window=50)
    res = reference.q_only_paged_attention(*args, return_lse=True, **kw)
    check(res, args, what="reference module", **kw)
    # the inputs make the cap matter
    uncapped = exact(*args, scale=0.7, window=50)[0]
    assert (res[0].double() - uncapped).abs().max() > 1e-2


def test_window_one_is_the_last_value():
    """window=1 attends only the newest entry, so the output is its V row exactly."""
    args = make([1, 16, 17, 40], 2, 4, 1, 64, torch.float32, block_size=16, layout="hnd", window=1)
    q, k, v, table, lens = args
    out = g.q_only_paged_attention(*args, window=1, backend="torch")
    for b, n in enumerate(lens.tolist()):
        last = v[int(table[b, (n - 1) // 16]), (n - 1) % 16, 0]
        assert torch.equal(out[b], last.expand(2, 4, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_buffer_poisoned_and_returned(dtype):
    args = make([0, 20, 9], 4, 4, 2, 64, dtype, block_size=8, window=12)
    out = poisoned(args[0].shape, dtype)
    o, lse = g.q_only_paged_attention(*args, window=12, out=out, return_lse=True, backend="torch")
    assert o is out
    check((o, lse), args, window=12, what="out=")
    out2 = poisoned(args[0].shape, dtype)
    assert g.q_only_paged_attention(*args, window=12, out=out2, backend="torch") is out2
    assert torch.equal(out2, out)


def test_unread_slots_and_table_entries_do_not_matter():
    """Changing everything the call must not read (unused slots, spare blocks, table entries past the end
    and before the window) leaves the result bitwise unchanged."""
    bs, window = 8, 10
    args = make([30, 7, 0, 17], 2, 4, 2, 64, torch.float32, block_size=bs, layout="kv_split", window=window)
    q, k, v, table, lens = args
    before = run(args, window=window)
    read = torch.zeros(k.shape[:2], dtype=torch.bool)
    table2 = table.clone()
    for b, n in enumerate(lens.tolist()):
        for p in range(max(0, n - window), n):
            read[int(table[b, p // bs]), p % bs] = True
        first, last = max(0, n - window) // bs, (n + bs - 1) // bs
        table2[b, :first] = 10**9
        table2[b, last:] = -(10**9)
    k2, v2 = k.clone(), v.clone()
    k2[~read], v2[~read] = 1e30, -1e30
    after = run((q, k2, v2, table2, lens), window=window)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    check(after, (q, k2, v2, table2, lens), window=window, what="after")


def test_queries_do_not_mask_each_other():
    """All Q queries of a request see the same keys: permuting the queries permutes the output."""
    args = make([25], 5, 4, 2, 64, torch.float32, block_size=8)
    q = args[0]
    perm = torch.tensor([3, 0, 4, 1, 2])
    out = g.q_only_paged_attention(*args, backend="torch")
    out_p = g.q_only_paged_attention(q[:, perm].contiguous(), *args[1:], backend="torch")
    assert torch.equal(out_p, out[:, perm])
