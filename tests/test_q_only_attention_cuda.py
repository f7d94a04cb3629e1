"""CUDA q_only_paged_attention against the reference (SPEC §4.2, §6). Needs a GPU (marked `gpu`).

The matrix follows tests/test_q_only_attention_triton.py, at the real sizes the interpreter cannot
afford, plus long contexts (the split-KV + merge path), every row-tile shape of the tensor-core kernel
(GQA 1-8 x tree levels Q 1-5), odd block sizes and strides at D 512, back-to-back dependent calls
(programmatic dependent launch on sm_90), CUDA-graph replay and torch.compile. On an H100/H200 this
runs the sm_90 path (bulk copies); the sm_80 path (cp.async) runs on an A100, and on the CPU through
tests/test_q_only_attention_emulated.py.
"""
import pytest
import torch

from gemma4_mtp_kernels import cuda as cuda_backend
from gemma4_mtp_kernels import q_only_paged_attention
from helpers import CACHE_LAYOUTS, DRAFTERS, assert_tolerance, paged_kv, poisoned

pytestmark = pytest.mark.gpu
DEV = "cuda"


def references(q, k, v, table, lens, **kw):
    """fp32 reference (the near-exact result) and the reference in the kernel's dtype, on the CPU."""
    cpu = [t.cpu() for t in (q, k, v, table, lens)]
    exact, exact_lse = q_only_paged_attention(cpu[0].float(), cpu[1].float(), cpu[2].float(), *cpu[3:],
                                              return_lse=True, backend="torch", **kw)
    same = q_only_paged_attention(*cpu, backend="torch", **kw)
    return exact, exact_lse, same


def check(got, lse, q, k, v, table, lens, what, **kw):
    exact, exact_lse, same = references(q, k, v, table, lens, **kw)
    got, lse = got.cpu(), lse.cpu()
    atol = 2e-5 if q.dtype == torch.float32 else 1e-5
    assert_tolerance(got, exact, same, atol=atol, what=what)
    empty = torch.isinf(exact_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all()), what
    assert bool((got[empty.nonzero(as_tuple=True)] == 0).all()), f"{what}: empty requests give 0"
    # lse is fp32 in both: summation order and exp2/log2 against exp/log separate them, a few ulps of
    # its magnitude (scores of randn q, k grow like sqrt(D))
    lse_atol = 1e-4 + 5e-7 * float(exact_lse[~empty].abs().max()) if bool((~empty).any()) else 1e-4
    assert_tolerance(lse[~empty], exact_lse[~empty], exact_lse[~empty], atol=lse_atol, what=what + " lse")


def run_case(seq_lens, Qn, Hq, Hkv, D, *, dtype=torch.bfloat16, block_size=16, layout="nhd", window=None,
             softcap=None, scale=1.0):
    k, v, table, lens = paged_kv(seq_lens, block_size, Hkv, D, dtype=dtype, layout=layout, window=window, device=DEV)
    B = len(seq_lens)
    q = torch.randn(B, Qn, Hq, D, device=DEV).to(dtype)
    out = poisoned((B, Qn, Hq, D), dtype, device=DEV)
    kw = dict(scale=scale, window=window, softcap=softcap)
    got, lse = q_only_paged_attention(q, k, v, table, lens, out=out, return_lse=True, backend="cuda", **kw)
    assert got is out and lse.dtype == torch.float32 and lse.shape == (B, Qn, Hq)
    what = f"lens={seq_lens} Q={Qn} Hq={Hq} Hkv={Hkv} D={D} {dtype} {layout} bs={block_size} window={window} softcap={softcap}"
    check(got, lse, q, k, v, table, lens, what, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("Qn", [1, 4])
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("layer", ["swa", "full"])
def test_drafter_shapes(name, layer, Qn, dtype):
    d = DRAFTERS[name]
    Hkv, D = d[f"Hkv_{layer}"], d[f"D_{layer}"]
    window = d["window"] if layer == "swa" else None
    run_case([700, 1500, 3], Qn, d["Hq"], Hkv, D, window=window, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_head_dims_and_dtypes(D, dtype):
    run_case([33, 200, 5], 3, 8, 2, D, dtype=dtype)


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("D", [256, 512])
def test_cache_layouts(layout, D):
    run_case([50, 97, 300], 1, 4, 2, D, layout=layout, block_size=8)


@pytest.mark.parametrize("window", [1, 15, 16, 17, 64, 65, 512, 1000])
def test_windows(window):
    run_case([64, 100, 10, 700], 2, 4, 1, 256, window=window)


@pytest.mark.parametrize("block_size", [1, 16, 17, 64])
def test_awkward_lengths_and_block_sizes(block_size):
    bs = block_size
    run_case([0, 1, max(bs - 1, 0), bs, bs + 1, 3 * bs + 5], 3, 4, 2, 128, block_size=bs)


def test_softcap_and_scale():
    run_case([90, 40, 1200], 2, 4, 2, 256, softcap=2.0, scale=0.3)


def test_rows_beyond_one_tile():
    run_case([45, 300], 9, 16, 2, 64)  # 9 * 8 = 72 rows: nine row tiles of the same KV head


@pytest.mark.parametrize("D,window", [(512, None), (256, 1024), (256, None)])
def test_long_context_small_batch(D, window):
    """B = 1 at 32K keys: the split-KV path with hundreds of splits and the merge kernel."""
    run_case([32768], 1, 4, 1, D, window=window, block_size=16)
    run_case([20000, 9000], 1, 8, 2, D, window=window, block_size=32)


@pytest.mark.parametrize("D", [256, 512])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("Qn", [1, 2, 4, 5])
def test_gqa_groups_and_tree_levels(D, G, Qn):
    """Q x G rows per KV head: 16-row CTAs (up to 16 rows), 32-row CTAs (17-32, e.g. 31B's 4-branch tree
    levels), and two row tiles (Q 5 x G 8 = 40 rows); long enough for several splits per request."""
    run_case([3000, 17, 700], Qn, 2 * G, 2, D)


@pytest.mark.parametrize("block_size", [1, 17, 64])
def test_head_dim_512_with_odd_block_sizes(block_size):
    """Rows of D 512 copied one by one (a bulk copy each on sm_90) whatever the block size."""
    run_case([0, 1, 3 * block_size + 5, 2500], 2, 8, 2, 512, block_size=block_size)


@pytest.mark.parametrize("D", [256, 512])
def test_padded_head_stride(D):
    """K/V rows D elements long inside wider rows (strides multiples of 16 bytes, not of D)."""
    k, v, table, lens = paged_kv([900, 40], 16, 2, D + 8, dtype=torch.bfloat16, device=DEV)
    k, v = k[..., :D], v[..., :D]
    q = torch.randn(2, 2, 8, D, device=DEV).to(torch.bfloat16)
    out = poisoned(q.shape, torch.bfloat16, device=DEV)
    got, lse = q_only_paged_attention(q, k, v, table, lens, out=out, return_lse=True, backend="cuda")
    check(got, lse, q, k, v, table, lens, f"padded head stride D={D}")


@pytest.mark.parametrize("first,second", [("cuda", "cuda"), ("triton", "cuda"), ("cuda", "triton")])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_dependent_calls_see_each_others_output(first, second, graph):
    """On sm_90 both backends launch with programmatic dependent launch: a kernel may start before the
    previous one ends and must wait (griddepcontrol.wait) before reading. A second attention whose
    queries ARE the first one's output (no kernel in between; poisoned with NaN before), back to back
    on one stream and in one CUDA graph, must equal the reference applied twice."""
    D, Hq, Hkv = 512, 4, 1
    k, v, table, lens = paged_kv([5000], 16, Hkv, D, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(1, 1, Hq, D, device=DEV).to(torch.bfloat16)
    mid = poisoned(q.shape, torch.bfloat16, device=DEV)
    out = poisoned(q.shape, torch.bfloat16, device=DEV)

    def step():
        q_only_paged_attention(q, k, v, table, lens, out=mid, backend=first)
        q_only_paged_attention(mid, k, v, table, lens, out=out, backend=second)

    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        mid.fill_(float("nan"))
        out.fill_(float("nan"))
        g.replay()
    else:
        step()
    torch.cuda.synchronize()
    exact_mid, _, same_mid = references(q, k, v, table, lens)
    assert_tolerance(mid.cpu(), exact_mid, same_mid, what=f"first call ({first})")
    exact, _, same = references(mid, k, v, table, lens)
    assert_tolerance(out.cpu(), exact, same, what=f"second call ({second}) after {first}")


def test_short_requests_under_a_wide_block_table():
    """An engine's block table sized for 128K keys: the launch plans for that bound, each request
    spreads its own range over the splits, and the garbage columns past its end are never read."""
    k, v, table, lens = paged_kv([1000, 37, 0, 300], 16, 2, 256, dtype=torch.bfloat16, device=DEV)
    wide = torch.randint(-(10**6), 10**6, (table.shape[0], 8192), dtype=torch.int32, device=DEV)
    wide[:, : table.shape[1]] = table
    q = torch.randn(4, 2, 8, 256, device=DEV).to(torch.bfloat16)
    out = poisoned(q.shape, torch.bfloat16, device=DEV)
    got, lse = q_only_paged_attention(q, k, v, wide, lens, out=out, return_lse=True, backend="cuda")
    check(got, lse, q, k, v, table, lens, "wide block table")


def test_all_empty_requests():
    run_case([0, 0], 1, 4, 1, 256)


def test_bad_block_id_gives_nan_not_a_read():
    """Unchecked GPU call: an id outside [0, num_blocks) among the read blocks poisons that request."""
    k, v, table, lens = paged_kv([40, 40, 5000], 16, 1, 256, dtype=torch.bfloat16, device=DEV)
    table[1, 1] = 10**6
    table[2, 100] = -3
    q = torch.randn(3, 1, 2, 256, device=DEV).to(torch.bfloat16)
    out, lse = cuda_backend.q_only_paged_attention(q, k, v, table, lens, return_lse=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out[0]).any() and not torch.isnan(lse[0]).any()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()


def test_seq_len_beyond_the_table_gives_nan():
    k, v, table, lens = paged_kv([40, 40], 16, 1, 128, dtype=torch.float16, device=DEV)
    lens[1] = table.shape[1] * 16 + 1
    q = torch.randn(2, 1, 2, 128, device=DEV).to(torch.float16)
    out, lse = cuda_backend.q_only_paged_attention(q, k, v, table, lens, return_lse=True)
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()


def test_misaligned_layout_is_refused_naming_the_argument():
    k, v, table, lens = paged_kv([40], 16, 2, 64, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(1, 1, 4, 64 + 1, device=DEV).to(torch.bfloat16)[..., 1:]  # 16-byte misaligned rows
    with pytest.raises(ValueError, match="q"):
        q_only_paged_attention(q, k, v, table, lens, backend="cuda")


@pytest.mark.parametrize("D,window", [(512, None), (256, 512)], ids=["merge_kernel", "in_kernel_merge"])
def test_cuda_graph_capture_and_replay(D, window):
    """Captured once, replayed with new seq_lens and queries (same bound on the context): no host
    sync, no allocation at replay, results equal to the reference each time. Both merges: the merge
    kernel (a full layer's many splits) and the attention kernel's own (a sliding layer's 8 splits,
    whose counters every replay must find zero)."""
    B, Qn, Hq, Hkv = 2, 1, 4, 1
    k, v, table, lens = paged_kv([900, 2000], 16, Hkv, D, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(B, Qn, Hq, D, device=DEV).to(torch.bfloat16)
    out = poisoned((B, Qn, Hq, D), torch.bfloat16, device=DEV)
    lse = None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (first-call setup)
        q_only_paged_attention(q, k, v, table, lens, out=out, window=window, backend="cuda")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = q_only_paged_attention(q, k, v, table, lens, out=out, window=window, return_lse=True, backend="cuda")
    for new_lens in ([900, 2000], [17, 1999], [0, 640]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(B, Qn, Hq, D).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, q, k, v, table, lens, f"graph replay lens={new_lens} window={window}", window=window)


def test_torch_compile_fullgraph():
    k, v, table, lens = paged_kv([300, 77], 16, 2, 256, dtype=torch.bfloat16, window=128, device=DEV)
    q = torch.randn(2, 2, 4, 256, device=DEV).to(torch.bfloat16)

    def step(q, k, v, table, lens):
        out, lse = q_only_paged_attention(q, k, v, table, lens, window=128, return_lse=True, backend="cuda")
        return out * 2, lse

    got, lse = torch.compile(step, fullgraph=True)(q, k, v, table, lens)
    check(got / 2, lse, q, k, v, table, lens, "compiled", window=128)


def test_opcheck():
    k, v, table, lens = paged_kv([60, 7], 16, 2, 128, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(2, 1, 4, 128, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(2, 1, 4, device=DEV)
    cuda_backend._ops()
    torch.library.opcheck(torch.ops.gemma4_mtp.q_only_paged_attention.default,
                          (q, k, v, table, lens, 1.0, 0, 0.0, out, lse))
