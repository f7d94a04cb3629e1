"""Triton rms_norm_linear / rms_norm_gate_up / rms_norm_q_rope against the fp64 oracle with Hugging
Face's rounding points (cases_fused_glue), under the interpreter on CPU; outputs poisoned first.

Covers the launch paths: split-K with the last-program fixup and the direct store, token tiles
(T > 64), strided rows, every prologue, head dims 64..512 with plain and proportional RoPE, tree
levels sharing a position, and the self-resetting counters."""
import importlib

import pytest
import torch

import gemma4_mtp_kernels as g
from cases_fused_glue import DTYPES, PROLOGUES, check_glue, check_mlp_replays, make_prologue, weight
from gemma4_mtp_kernels.triton.rms_norm_linear import ROW_K_MAX, launch_config, row_tile
from gemma4_mtp_kernels.triton.rms_norm_q_rope import launch_config as launch_config_q_rope
from gemma4_mtp_kernels.triton._common import num_sms
from gemma4_mtp_kernels._counters import zeroed_counters
from helpers import DRAFTERS

GEN = torch.Generator


def linear(T, H, N, dtype, kind, device="cpu", **kw):
    return check_glue("rms_norm_linear", "triton", device, T, H, N, dtype, kind, gen=GEN().manual_seed(T + H + N), **kw)


def gate_up(T, H, I, dtype, kind, device="cpu", **kw):
    return check_glue("rms_norm_gate_up", "triton", device, T, H, I, dtype, kind, gen=GEN().manual_seed(T + H + I),
                      **kw)


def mlp(T, H, I, N, dtype, kind, device="cpu", **kw):
    return check_glue("rms_norm_gate_up", "triton", device, T, H, I, dtype, kind, gen=GEN().manual_seed(T + H + I + N),
                      down=N, **kw)


def q_rope(T, H, Hq, D, dtype, kind, device="cpu", **kw):
    return check_glue("rms_norm_q_rope", "triton", device, T, H, Hq * D, dtype, kind, gen=GEN().manual_seed(T + H + D),
                      D=D, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_linear_prologues(kind, dtype):
    linear(3, 200, 72, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_gate_up_prologues(kind, dtype):
    gate_up(3, 136, 40, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_q_rope_prologues(kind, dtype):
    q_rope(4, 72, 2, 64, dtype, kind, per_pos=2)


@pytest.mark.parametrize("D", [64, 256, 512])
@pytest.mark.parametrize("kind", PROLOGUES)
def test_q_rope_one_token(kind, D):
    """T = 1 (a decode step at batch 1) has its own epilogue tile: one token instead of 2048 / D; and
    its prologue statistics from the row loaded whole (row_tile)."""
    assert launch_config_q_rope(1, 2 * D, D)["EPI_T"] == 1 < launch_config_q_rope(2, 2 * D, D)["EPI_T"]
    q_rope(1, 72, 2, D, torch.bfloat16, kind, proportional=D == 512)


@pytest.mark.parametrize("H", [72, 256, 1100])  # 1100: past ROW_K_MAX, the statistics loops
@pytest.mark.parametrize("kind", PROLOGUES)
def test_one_token_prologues(kind, H):
    """T = 1 takes each prologue's statistics from its row as vectors (x, the residual and its norm weight
    loaded at once) where it has one and the row fits ROW_K_MAX columns."""
    flags = dict(HAS_RES=kind in ("residual", "layer"), HAS_NORM=kind != "none")
    expected = 0 if H > ROW_K_MAX or not any(flags.values()) else 1 << (H - 1).bit_length()
    assert row_tile(1, H, flags) == expected and row_tile(2, H, flags) == 0
    linear(1, H, 40, torch.bfloat16, kind)
    gate_up(1, H, 24, torch.bfloat16, kind)
    q_rope(1, H, 1, 64, torch.bfloat16, kind)


def test_linear_split_and_direct_paths():
    """Few row tiles split K (partials + the last split's fixup); many tokens store directly."""
    sms = num_sms(torch.device("cpu"))
    assert launch_config(1, 1024, 32, sms)["split_k"] > 1
    assert launch_config(1, 16384, 1024, 132)["split_k"] == 16  # 31B o_proj on an H200: 16 blocks each
    assert launch_config(64, 128, 256, sms)["split_k"] == 1
    # a chosen split count is kept within the K blocks; a chosen K block re-derives the split's blocks
    assert launch_config(1, 16384, 1024, 132, split_k=1)["split_k"] == 1
    assert launch_config(1, 1024, 1024, 132, split_k=64)["split_k"] == 16
    assert launch_config(1, 16384, 1024, 132, block_k=128)["kb_per_split"] == 8
    linear(1, 1024, 32, torch.bfloat16, "none")
    linear(2, 1000, 40, torch.float32, "layer")  # split with the prologue, ragged last K block
    linear(64, 128, 256, torch.bfloat16, "norm")


@pytest.mark.parametrize("T", [17, 70])  # 70: two token tiles
def test_token_tiles(T):
    linear(T, 96, 48, torch.bfloat16, "layer")
    gate_up(T, 96, 40, torch.bfloat16, "layer")
    q_rope(T, 64, 1, 64, torch.bfloat16, "layer", per_pos=T // 5 if T % 5 == 0 else 1)


@pytest.mark.parametrize("D,proportional", [(64, False), (128, True), (256, False), (512, True)])
def test_head_dims(D, proportional):
    q_rope(2, 64, 3, D, torch.bfloat16, "norm", proportional=proportional)


def test_tree_levels_share_a_position():
    """T = P * Q: the Q queries of each request (tree branches) take that request's position."""
    q_rope(12, 64, 2, 64, torch.bfloat16, "layer", per_pos=4)


def test_strided_rows():
    linear(5, 96, 40, torch.bfloat16, "layer", strided=True)
    gate_up(5, 96, 40, torch.bfloat16, "residual", strided=True)
    q_rope(5, 96, 1, 64, torch.bfloat16, "layer", strided=True)


def test_without_the_optional_outputs():
    linear(3, 96, 40, torch.bfloat16, "layer", outs=False)
    q_rope(3, 96, 1, 64, torch.bfloat16, "layer", outs=False)


# the package re-exports the op functions under the module names: import the modules by path
linear_module = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_linear")
q_rope_module = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_q_rope")
gate_up_module = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_gate_up")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_mlp_prologues(kind, dtype):
    """The whole MLP in one launch (T <= MLP_MAX_T): 5 programs of 32 rows (the last one ragged) in groups
    of 4, the last group of one; N = 72 over two down_proj row blocks (the second ragged)."""
    cfg = gate_up_module.mlp_config(3, 136)
    assert (cfg["programs"], cfg["GROUP"], cfg["groups"]) == (5, 4, 2)
    mlp(3, 96, 136, 72, dtype, kind)


@pytest.mark.parametrize("T", [1, 4, 5, 17])
def test_mlp_one_launch_up_to_four_tokens(T, monkeypatch):
    """Up to MLP_MAX_T tokens one launch of `_mlp_kernel`; above, gate_up's kernel and then down_proj's."""
    mlp(T, 64, 96, 48, torch.bfloat16, "layer")
    x, kw = make_prologue(T, 64, torch.bfloat16, "layer", GEN().manual_seed(0))
    wg, wu, wd = (weight(n, k, torch.bfloat16, None) for n, k in ((96, 64), (96, 64), (48, 96)))
    names = []

    class Spy:  # notes the kernel's name, then launches it
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            names.append(self.name)
            return self.kernel[grid]
    for module, name in ((gate_up_module, "_mlp_kernel"), (gate_up_module, "_gate_up_kernel"),
                         (linear_module, "_norm_linear_kernel")):
        monkeypatch.setattr(module, name, Spy(name, getattr(module, name)))
    g.rms_norm_gate_up(x, wg, wu, down_weight=wd, backend="triton", **kw)
    assert names == (["_mlp_kernel"] if T <= gate_up_module.MLP_MAX_T else ["_gate_up_kernel", "_norm_linear_kernel"])


def test_mlp_sums_many_groups():
    """E2B's grid: 2048 rows in 64 programs, groups of 8 (one wave of 8 partials per level), the flat [T, N]
    output in one 1024-value chunk (T = 4); and 19 programs in groups of 8 (the last of three), an output of
    three chunks (T = 3, N = 1000)."""
    assert [gate_up_module.mlp_config(1, 2048)[k] for k in ("programs", "GROUP", "groups", "SPLIT_LOADS")] \
        == [64, 8, 8, 8]
    assert [gate_up_module.mlp_config(3, 600)[k] for k in ("programs", "GROUP", "groups")] == [19, 8, 3]
    mlp(4, 256, 2048, 256, torch.bfloat16, "residual")
    mlp(3, 64, 600, 1000, torch.float32, "layer")


def test_mlp_is_one_launch_for_the_small_drafters_at_few_tokens():
    """E2B / E4B (3 MiB of MLP weights) up to 4 tokens; 26B / 31B (48 MiB) never (their weights stream from
    DRAM: the module's note)."""
    for name, d in DRAFTERS.items():
        for T in (1, 4, 5):
            want = T <= 4 and d["Hd"] == 256
            assert gate_up_module.one_launch(T, d["Hd"], d["inter"], d["Hd"], 2) is want, (name, T)


def test_mlp_counters_are_left_zero():
    mlp(2, 64, 300, 40, torch.bfloat16, "layer")
    assert not zeroed_counters(torch.device("cpu"), 64, gate_up_module.COUNTER_OWNER).any()


def test_prologue_loops_unroll_no_further_than_the_row():
    """The decode tiles' statistics loops issue up to 16 / 8 K blocks of loads at once, never more than
    the row has (a loop unrolled past its trip count runs its one-block remainder loop: a round trip per
    block); larger tiles and fp32 keep the unrolling their registers allow."""
    from gemma4_mtp_kernels.triton.rms_norm_linear import prologue_unroll
    assert prologue_unroll(1024, 64, 16, 2) == dict(STATS_UNROLL=16, NORM_UNROLL=8)  # 26B / 31B
    assert prologue_unroll(256, 64, 16, 2) == dict(STATS_UNROLL=4, NORM_UNROLL=4)  # E2B / E4B
    assert prologue_unroll(150, 64, 16, 2) == dict(STATS_UNROLL=2, NORM_UNROLL=2)  # 3 blocks: a power of two
    assert prologue_unroll(1024, 64, 64, 2) == prologue_unroll(1024, 64, 16, 4) == dict(STATS_UNROLL=None,
                                                                                        NORM_UNROLL=4)


def test_q_rope_slices_divide_the_head():
    """A head's D / BLOCK_N programs elect its epilogue: a slice width that does not divide D is refused."""
    assert q_rope_module.launch_config(1, 4096, 512)["BLOCK_N"] == 64
    with pytest.raises(ValueError, match="block_n: must divide the head dim 256, got 48"):
        q_rope_module.launch_config(1, 1024, 256, block_n=48)


def test_counters_are_left_zero():
    """The split-K fixup and the q heads count programs in a cached buffer that no memset resets:
    each launch must leave it zero, or the next launch (a CUDA-graph replay) would miscount."""
    linear(1, 1024, 32, torch.bfloat16, "none")
    q_rope(3, 64, 4, 128, torch.bfloat16, "layer")
    for module in (linear_module, q_rope_module):
        assert not zeroed_counters(torch.device("cpu"), 1, module.COUNTER_OWNER).any()


def test_empty_batch():
    x, kw = make_prologue(0, 32, torch.bfloat16, "layer", GEN().manual_seed(0))
    out = g.rms_norm_linear(x, weight(8, 32, torch.bfloat16, None), backend="triton", **kw)
    assert out.shape == (0, 8)
    q = g.rms_norm_q_rope(x, weight(64, 32, torch.bfloat16, None), torch.ones(64, dtype=torch.bfloat16),
                          torch.zeros(0, dtype=torch.long), torch.ones(32), backend="triton", **kw)
    assert q.shape == (0, 1, 64)


def test_real_shapes():
    """One token through every projection of a real E2B drafter layer (bf16). (31B's run only on a
    GPU: ~6 minutes in the interpreter.)"""
    d = DRAFTERS["E2B"]
    Hd, Hq = d["Hd"], d["Hq"]
    q_rope(1, Hd, Hq, d["D_full"], torch.bfloat16, "layer", proportional=True)
    linear(1, Hq * d["D_swa"], Hd, torch.bfloat16, "none")  # o_proj
    gate_up(1, Hd, d["inter"], torch.bfloat16, "residual")
    linear(1, Hd, d["Hb"], torch.bfloat16, "layer")  # post_projection with the final norm


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1, 64])
def test_real_shapes_on_gpu(name, T):
    d = DRAFTERS[name]
    Hd, Hq = d["Hd"], d["Hq"]
    for D, prop in ((d["D_swa"], False), (d["D_full"], True)):
        q_rope(T, Hd, Hq, D, torch.bfloat16, "layer", device="cuda", proportional=prop)
        linear(T, Hq * D, Hd, torch.bfloat16, "none", device="cuda")
    gate_up(T, Hd, d["inter"], torch.bfloat16, "residual", device="cuda")
    linear(T, d["inter"], Hd, torch.bfloat16, "none", device="cuda")
    mlp(T, Hd, d["inter"], Hd, torch.bfloat16, "layer", device="cuda")  # one launch for E2B / E4B at T = 1
    linear(T, Hd, d["Hb"], torch.bfloat16, "layer", device="cuda")
    for module in (linear_module, q_rope_module, gate_up_module):
        assert not zeroed_counters(torch.device("cuda"), 1, module.COUNTER_OWNER).any()


@pytest.mark.gpu
def test_rms_norm_gate_up_one_launch_mlp_replays_in_a_cuda_graph():
    d = DRAFTERS["E2B"]
    assert gate_up_module.one_launch(1, d["Hd"], d["inter"], d["Hd"], 2)
    check_mlp_replays("triton")


@pytest.mark.gpu
def test_compiled_drafter_step_on_gpu():
    """torch.compile(fullgraph=True) of a whole E2B step (Triton glue, the four ops' Triton kernels)
    equals the eager step."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context
    drafter = random_drafter("E2B", device="cuda", backend="triton")
    ctx = synthetic_context(drafter, 2, 4096, device="cuda")
    tokens = torch.tensor([[5], [70000]], device="cuda")
    hidden = torch.randn(2, 1, 1536, device="cuda").to(torch.bfloat16)
    want = drafter.step(ctx, tokens, hidden)
    torch._dynamo.reset()
    got = torch.compile(lambda t, h: drafter.step(ctx, t, h), fullgraph=True)(tokens, hidden)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_linear_sums_more_splits_than_it_loads_at_once(monkeypatch):
    """An H200's split count on CPU (the interpreter's SM count raised to 132): 11 partials of one tile
    summed 8 at a time (sum_splits), the second group three partials and five masked."""
    from gemma4_mtp_kernels.triton import _common
    monkeypatch.setattr(_common, "INTERPRETER_SMS", 132)
    cfg = launch_config(1, 1408, 32, num_sms(torch.device("cpu")))
    assert (cfg["split_k"], cfg["SPLIT_LOADS"]) == (11, 8)
    linear(1, 1408, 32, torch.bfloat16, "none")
    linear(1, 1408, 32, torch.float32, "layer")
