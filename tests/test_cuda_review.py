"""GPU checks of CUDA-kernel behaviour found in the pre-GPU review (marked `gpu`, skip without one).

Each test targets one rule whose host-side logic is covered by csrc/tests/test_tree.cpp but whose
effect only shows when the kernel runs: masked (-inf) logits in sampling rows, NaN logits in greedy
rows, sampling rows without a distribution, an attention `out=` that is contiguous but not 16-byte
aligned, and attention inputs the kernels cannot read (refused with an error naming them, never a crash).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases_tree_verify import assert_matches_reference, drafts_following, logits_for, random_tree
from gemma4_mtp_kernels import q_only_paged_attention, tree_verify
from gemma4_mtp_kernels.cuda import tree_verify as cuda_tree_verify
from helpers import assert_tolerance, paged_kv

pytestmark = pytest.mark.gpu
DEV = "cuda"


def verify_both(tokens, parents, logits, **kw):
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = tree_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV), backend="cuda", **dev_kw)
    got = type(got)(*(t.cpu() for t in got))
    ref = tree_verify(tokens, parents, logits, backend="torch", **kw)
    assert_matches_reference(got, ref, tokens, parents, logits, **kw)
    return got, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_rows_with_masked_logits(dtype):
    """Most of the vocabulary at -inf, including the first ids of every chunk: a chunk's softmax
    statistics must ignore them (exp(-inf - -inf) would make the row NaN), and no masked id may be
    sampled."""
    g = torch.Generator().manual_seed(11)
    B, N, V = 3, 5, 262144
    parents = random_tree(B, N, g)
    logits = (torch.randn(B, N, V, generator=g) * 2).to(dtype)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[torch.randperm(V, generator=g)[:300]] = True
    keep[:8192] = False  # whole leading chunks masked
    logits[..., ~keep] = float("-inf")
    temperature = torch.tensor([1.0, 0.7, 0.0])
    uniforms = torch.rand(B, N, 2, generator=g)
    samples = torch.stack([torch.stack([torch.multinomial(torch.softmax(logits[b, i].float(), 0), 1, generator=g)[0]
                                        for i in range(N)]) for b in range(B)])
    tokens = drafts_following(samples, parents, V, g, hit=0.8)
    got, _ = verify_both(tokens, parents, logits, temperature=temperature, uniforms=uniforms)
    emitted = got.output_tokens[got.output_tokens >= 0]
    assert bool(keep[emitted].all()), "a masked (-inf) id was emitted"


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_chain_with_draft_probs_and_masked_logits(q_dtype):
    g = torch.Generator().manual_seed(12)
    B, N, V = 2, 4, 20000
    parents = random_tree(B, N, g, chain=True)
    logits = torch.randn(B, N, V, generator=g)
    logits[..., : V // 2] = float("-inf")
    q = torch.softmax(logits * 0.8 + torch.randn(B, N, V, generator=g) * 0.3, -1)
    tokens = torch.stack([torch.stack([torch.multinomial(q[b, max(i - 1, 0)], 1, generator=g)[0] for i in range(N)])
                          for b in range(B)])
    uniforms = torch.rand(B, N, 2, generator=g)
    got, _ = verify_both(tokens, parents, logits.to(q_dtype), temperature=torch.tensor([1.0, 0.8]), uniforms=uniforms,
                         draft_probs=q.to(q_dtype))
    assert bool((got.output_tokens[got.output_tokens >= 0] >= V // 2).all())


@pytest.mark.parametrize("sampling", [False, True])
def test_padding_rows_are_read_but_never_decide(sampling):
    """Every CTA reads its row's logits without first loading parents[u] (one dependent DRAM round
    trip less): NaN logits in padding slots' rows must not reach any output."""
    g = torch.Generator().manual_seed(13)
    B, N, V = 6, 9, 30000
    parents = random_tree(B, N, g)
    assert bool((parents[:, 1:] < 0).any())  # some padding
    logits = logits_for(B, N, V, torch.bfloat16, g)
    logits[parents < 0] = float("nan")
    logits[:, 0] = logits_for(B, 1, V, torch.bfloat16, g)[:, 0]  # the root is always used
    tokens = drafts_following(logits.float().nan_to_num(-1e9).argmax(-1), parents, V, g, hit=0.8)
    kw = dict(temperature=torch.rand(B, generator=g) + 0.5, uniforms=torch.rand(B, N, 2, generator=g)) if sampling else {}
    verify_both(tokens, parents, logits, **kw)


def test_greedy_rows_with_nan_logits_follow_torch_argmax():
    """The public op refuses NaN logits only where it checks values (CPU); on the GPU the kernel must
    still pick like torch.argmax (NaN counts as the maximum, the first NaN wins), so a row of NaN gives
    id 0, never an id outside the vocabulary. torch.argmax is the oracle (the reference refuses NaN)."""
    V = 70000
    logits = torch.randn(3, 2, V)
    logits[0, 0, [40000, 65000]] = float("nan")
    logits[1, 0] = float("nan")
    logits[2, 0, 12] = float("nan")
    logits[2, 0, 13] = float("inf")
    parents = torch.tensor([[-1, 0]] * 3, dtype=torch.int32)
    tokens = torch.tensor([[5, 40000], [5, 0], [5, 12]])
    got = tree_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV), backend="cuda")
    pick = torch.argmax(logits, dim=-1)  # [3, 2]: node 0's pick is the drafted child, node 1's the bonus
    assert pick[:, 0].tolist() == [40000, 0, 12]
    assert got.accept_len.cpu().tolist() == [1, 1, 1]
    assert got.accepted_nodes.cpu().tolist() == [[1, -1]] * 3
    assert got.output_tokens.cpu().tolist() == [[int(pick[b, 0]), int(pick[b, 1])] for b in range(3)]
    assert got.last_node.cpu().tolist() == [1, 1, 1]


@pytest.mark.parametrize("V", [1000, 20001])  # one chunk with 16-byte loads; several with scalar loads
@pytest.mark.parametrize("bad", ["-inf", "nan", "one nan", "overflowing temperature"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampling_row_without_mass_gives_token_minus_one(V, bad, with_draft_probs):
    """Mirror of the Triton test of the same name: a sampling row with no distribution (all -inf
    logits, a NaN, or x / temperature overflowing) is refused by the op's value checks, which do not
    run on the GPU by default. The kernel must then emit the bonus token -1 and stop (never a token
    sampled from NaN probabilities or an out-of-vocabulary id). Called on the backend directly, as an
    unchecked CUDA call reaches it."""
    g = torch.Generator().manual_seed(11)
    B, N = 3, 3
    logits = logits_for(B, N, V, torch.float32, g)
    temperature = torch.ones(B)
    if bad == "one nan":
        logits[1, 0, 777] = float("nan")
    elif bad == "overflowing temperature":
        logits[1, 0, 123] = 10.0  # 10 / 1e-38 overflows to +inf
        temperature[1] = 1e-38
    else:
        logits[1, 0] = float(bad)
    parents = random_tree(B, N, g, chain=True)
    tokens = drafts_following(logits.argmax(-1), parents, V, g, hit=0.0)
    tokens[1, 1] = -1  # an unchecked, invalid draft token equal to the "no token" answer is not accepted
    kw = dict(temperature=temperature.to(DEV), uniforms=torch.rand(B, N, 2, generator=g).to(DEV))
    if with_draft_probs:
        kw["draft_probs"] = torch.softmax(torch.randn(B, N, V, generator=g), -1).to(DEV)
    for _ in range(3):  # the workspace counters must come back to zero after such a row
        got = cuda_tree_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV), **kw)
        got = type(got)(*(t.cpu() for t in got))
        assert got.output_tokens[1].tolist() == [-1] * N and int(got.accept_len[1]) == 0
        assert int(got.last_node[1]) == 0 and got.accepted_nodes[1].tolist() == [-1] * N
        healthy = got.output_tokens[[0, 2]]
        assert bool((healthy[:, 0] >= 0).all()) and bool((healthy < V).all())


@pytest.mark.parametrize("splits", ["one", "many"])
def test_attention_out_at_an_unaligned_offset(splits):
    """out is written with scalar stores: a contiguous view that starts one element into its storage is
    accepted and fully written (it used to be refused as misaligned)."""
    lens = [37] if splits == "one" else [9000]
    k, v, table, seq_lens = paged_kv(lens, 16, 1, 256, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(1, 1, 4, 256, device=DEV).to(torch.bfloat16)
    storage = torch.full((q.numel() + 1,), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = storage[1:].view(q.shape)
    got = q_only_paged_attention(q, k, v, table, seq_lens, out=out, backend="cuda")
    assert got is out
    cpu = [t.cpu() for t in (q, k, v, table, seq_lens)]
    exact = q_only_paged_attention(cpu[0].float(), cpu[1].float(), cpu[2].float(), *cpu[3:], backend="torch")
    same = q_only_paged_attention(*cpu, backend="torch")
    assert_tolerance(out.cpu(), exact, same, atol=1e-5, what=f"unaligned out, {splits} split(s)")
    assert torch.isnan(storage[0].float())  # the element before the view is untouched


def test_attention_misaligned_cache_pointer_is_refused_naming_it():
    """The public op refuses a k_cache whose data pointer is 2 bytes past a 16-byte boundary (strides
    fine) before the extension is entered."""
    k, v, table, seq_lens = paged_kv([40], 16, 1, 64, dtype=torch.bfloat16, device=DEV)
    flat = torch.empty(k.numel() + 1, dtype=k.dtype, device=DEV)
    k_off = flat[1:].view(k.shape)  # strides fine, data pointer 2 bytes past a 16-byte boundary
    k_off.copy_(k)
    q = torch.randn(1, 1, 4, 64, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache"):
        q_only_paged_attention(q, k_off, v, table, seq_lens, backend="cuda")


# Calls the raw custom op (what a torch.compile graph calls: the Python wrapper's pointer check cannot
# trace) with one bad argument and prints the error. In a subprocess: on the first GPU run such a call
# (a misaligned k_cache) ended the whole pytest process with a segmentation fault.
RAW_OP_SCRIPT = """
import sys, torch
from gemma4_mtp_kernels import cuda as cuda_backend
from helpers import paged_kv
bad = sys.argv[1]
dev = "cuda"
k, v, table, lens = paged_kv([40], 16, 1, 64, dtype=torch.bfloat16, device=dev)
q = torch.randn(1, 1, 4, 64, device=dev).to(torch.bfloat16)
out, lse = torch.empty_like(q), torch.empty(1, 1, 4, device=dev)
if bad == "k_cache":
    flat = torch.empty(k.numel() + 1, dtype=k.dtype, device=dev)
    k = flat[1:].view(k.shape)
elif bad == "v_cache":
    flat = torch.empty(v.numel() + 4, dtype=v.dtype, device=dev)
    v = flat[4:].view(v.shape)  # 8 bytes off
elif bad == "q":
    q = torch.randn(1, 1, 4, 64 + 1, device=dev).to(torch.bfloat16)[..., 1:]
elif bad == "lse":
    lse = torch.empty(1, 1, 4, device=dev, dtype=torch.float64)
cuda_backend._ops()
try:
    torch.ops.gemma4_mtp.q_only_paged_attention(q, k, v, table, lens, 1.0, 0, 0.0, out, lse)
    torch.cuda.synchronize()
    print("NO ERROR")
except Exception as e:
    print(type(e).__name__ + ":", str(e).splitlines()[0])
"""


@pytest.mark.parametrize("bad", ["lse", "k_cache", "v_cache", "q"])
def test_attention_raw_op_refuses_bad_arguments_without_crashing(bad, tmp_path):
    """The C++ checks alone (no Python wrapper in front): a clean error naming the tensor, the process
    alive: a TypeError for lse's dtype, a ValueError for a misaligned layout, as the Python ops raise. `lse` (a dtype check, the first checks the op makes) tells a crash of every C++ error
    apart from one of the alignment checks."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "raw_op.py"
    script.write_text(RAW_OP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(script), bad], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, f"the raw op call died (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    expected = "TypeError:" if bad == "lse" else "ValueError:"
    assert run.stdout.startswith(expected) and bad in run.stdout, run.stdout + run.stderr[-2000:]
