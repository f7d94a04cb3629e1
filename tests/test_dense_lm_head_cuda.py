"""CUDA dense_lm_head (GPU only) against the fp64 oracle and the reference: the real 26B / 31B head,
one and several passes of 8 tokens, k up to 16, ties, NaN, the dense output, graph replay; its limits
are named. Never run on a GPU yet: the kernel is unverified and `auto` does not use it (verified.py).
Its registration (schema, fake) is checked without a GPU."""
import pytest
import torch

import gemma4_mtp_kernels as g
from cases_dense_lm_head import check_topk, make, ties_case
from gemma4_mtp_kernels import cuda as cuda_backend

DEV = torch.device("cuda")
gpu = pytest.mark.gpu


@pytest.mark.skipif(not cuda_backend.extension_status()[0], reason="cuda extension unavailable")
def test_schema_and_fake_without_a_gpu():
    """Registered with its three outputs written in place and a fake implementation (opcheck's
    schema and fake-tensor checks on meta tensors), as the four ops are (tests/test_cuda_opcheck.py)."""
    op = cuda_backend._ops().dense_lm_head
    schema = op.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "ids", "logits", "dense"]
    meta = dict(device="meta")
    args = (torch.empty(3, 64, dtype=torch.bfloat16, **meta), torch.empty(100, 64, dtype=torch.bfloat16, **meta), 4,
            "topk", torch.empty(3, 4, dtype=torch.long, **meta), torch.empty(3, 4, **meta), torch.empty(0, 0, **meta))
    result = torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result


@gpu
@pytest.mark.parametrize("T", [1, 3, 8, 19])  # 19: three passes of 8 tokens
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_real_head(T, k):
    hidden, lm_head = make(T, 1024, 262144, torch.bfloat16, torch.Generator().manual_seed(T * 31 + k))
    check_topk(hidden, lm_head, k, "cuda", device=DEV, what=f"T={T} k={k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@gpu
def test_dtypes_and_unaligned_rows(dtype):
    hidden, lm_head = make(4, 100, 5000, dtype, torch.Generator().manual_seed(1))  # 100: no 16-byte vectors
    check_topk(hidden, lm_head, 3, "cuda", device=DEV, what=f"{dtype} Hd=100")
    hidden, lm_head = make(4, 256, 5000, dtype, torch.Generator().manual_seed(2))
    check_topk(hidden, lm_head, 3, "cuda", device=DEV, what=f"{dtype} Hd=256")


@gpu
def test_ties_nan_and_signed_zeros():
    hidden, lm_head, order = ties_case(torch.bfloat16)
    ids, _ = g.dense_lm_head(hidden.to(DEV), lm_head.to(DEV), k=4, backend="cuda")
    assert ids[0].tolist() == order
    lm_head = torch.zeros(3000, 8, device=DEV)
    lm_head[2500] = float("nan")
    lm_head[2] = -1.0
    hidden = torch.tensor([[0.0] * 7 + [-0.0]], device=DEV)
    ids, vals = g.dense_lm_head(hidden, lm_head, k=3, backend="cuda")
    assert ids[0].tolist() == [2500, 0, 1] and torch.isnan(vals[0, 0]) and vals[0, 1:].tolist() == [0.0, 0.0]


@gpu
@pytest.mark.parametrize("T", [1, 8, 19])
def test_dense_output(T):
    hidden, lm_head = make(T, 1024, 262144, torch.bfloat16, torch.Generator().manual_seed(T))
    out = g.dense_lm_head(hidden.to(DEV), lm_head.to(DEV), output="dense", backend="cuda")
    torch.testing.assert_close(out.cpu(), hidden.float() @ lm_head.float().T, rtol=1e-4, atol=1e-3)


@gpu
def test_replays_in_a_cuda_graph():
    hidden, lm_head = make(2, 1024, 262144, torch.bfloat16, torch.Generator().manual_seed(5))
    hidden, lm_head = hidden.to(DEV), lm_head.to(DEV)
    want = g.dense_lm_head(hidden, lm_head, k=4, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = g.dense_lm_head(hidden, lm_head, k=4, backend="cuda")
    graph.replay()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@gpu
def test_limits_are_named():
    hidden, lm_head = make(2, 64, 100, torch.bfloat16, torch.Generator().manual_seed(0))
    wide, wide_head = make(2, 4096, 100, torch.bfloat16, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="hidden must have at most 3072 columns"):
        g.dense_lm_head(wide.to(DEV), wide_head.to(DEV), k=1, backend="cuda")
