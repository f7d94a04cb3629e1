"""Inputs, the fp64 oracle and the backend-vs-oracle checks of the fused glue ops (rms_norm_linear,
rms_norm_gate_up, rms_norm_q_rope), shared by every backend's tests.

The oracle computes in fp64 and rounds to the op's dtype exactly where Hugging Face's Gemma 4 rounds
(every norm output, the residual add, the layer scalar, each projection, gelu, the product, q_norm,
cos / sin, q * cos, rotated * sin and their sum): what the ops promise, without fp32 arithmetic
error. `assert_matches` says how close a backend must come to it, and to the reference.
"""
from __future__ import annotations

import functools
import math

import torch

import gemma4_mtp_kernels as g
from helpers import DRAFTERS, poisoned

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-6
PROLOGUES = ("none", "norm", "residual", "layer")  # x; norm(x); residual + norm(x) then norm; and * scalar


def rnd(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype).double()


def rms(x, w, eps, dtype):
    xd = x.double()
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return rnd(y if w is None else y * w.double(), dtype)


def exact_prologue(x, kw, dtype):
    """(h, n) in fp64 holding dtype values."""
    h = x.double()
    if kw.get("residual") is not None:
        h = rnd(kw["residual"].double() + rms(x, kw["residual_norm_weight"], EPS, dtype), dtype)
        if kw.get("layer_scalar") is not None:
            h = rnd(h * kw["layer_scalar"].double(), dtype)
    n = h if kw.get("norm_weight") is None else rms(h, kw["norm_weight"], EPS, dtype)
    return h, n


def exact_linear(n, w, dtype):
    return rnd(n @ w.double().T, dtype)


def exact_gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def exact_q_rope(n, w, q_norm_weight, positions, inv_freq, dtype):
    T, D = n.shape[0], q_norm_weight.shape[0]
    q = rms(exact_linear(n, w, dtype).view(T, -1, D), q_norm_weight, EPS, dtype)
    pos = positions.repeat_interleave(T // positions.shape[0]).double()
    # HF multiplies position and inv_freq in fp32: the angle is that fp32 number
    f = (pos.float()[:, None] * inv_freq[None, :]).double()
    f = torch.cat([f, f], dim=-1)
    cos, sin = rnd(torch.cos(f), dtype)[:, None], rnd(torch.sin(f), dtype)[:, None]
    half = D // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    return rnd(rnd(q * cos, dtype) + rnd(rotated * sin, dtype), dtype)


def make_prologue(T, H, dtype, kind, gen):
    """x [T, H] and the prologue keywords of `kind` (O(1) activations, norm weights away from 1)."""
    x = torch.randn(T, H, generator=gen).to(dtype)
    kw = {}
    if kind != "none":
        kw["norm_weight"] = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    if kind in ("residual", "layer"):
        kw["residual"] = (2 * torch.randn(T, H, generator=gen)).to(dtype)
        kw["residual_norm_weight"] = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    if kind == "layer":
        kw["layer_scalar"] = torch.tensor([0.73]).to(dtype)
    return x, kw


def weight(N, H, dtype, gen):
    return (torch.randn(N, H, generator=gen) / math.sqrt(max(H, 1))).to(dtype)


def rope_inv_freq(D, proportional=False):
    """Sliding layers: theta 1e4 over all pairs; full layers (proportional): the first quarter of
    the pairs with theta 1e6 over D, the rest 0 (identity), as gemma4_mtp.layers.rope_inv_freq."""
    if not proportional:
        return 1.0 / (10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    rotated = D // 8
    inv = 1.0 / (1_000_000.0 ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / D))
    return torch.cat([inv, torch.zeros(D // 2 - rotated)])


def assert_matches(got, exact, ref, dtype, what, *, max_mismatch=0.05):
    """got is within a few units of the dtype (at the tensor's scale) of the fp64 oracle, and in half
    precision differs from the reference `ref` (same dtype, same rounding points) in at most
    `max_mismatch` of the elements. Where an fp32 intermediate sits within its own rounding error of
    a rounding boundary the rounded value flips by one unit, and a flip upstream moves everything
    computed from it a little (a projection's outputs, a sum with cancellation): the oracle and the
    reference differ in up to ~12% of fp16 projection outputs this way, a backend and the reference
    (both fp32 arithmetic) in well under 1%. A skipped or misplaced rounding point flips a large
    fraction (a skipped rounding of q * cos: ~33%); a wrong norm or a missing term moves values far more."""
    assert not torch.isnan(got).any(), f"{what}: NaN (an element never written?)"
    got, exact, ref = got.double().cpu(), exact.double().cpu(), ref.double().cpu()
    scale = exact.abs().max().item() if exact.numel() else 0.0
    tol = (4 * torch.finfo(dtype).eps if dtype != torch.float32 else 4e-6) * max(scale, 1e-30)
    err = (got - exact).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= tol, f"{what}: max error {worst:.3e} > {tol:.3e} (scale {scale:.3e})"
    if dtype != torch.float32 and got.numel():
        frac = (got != ref).double().mean().item()
        assert frac <= max_mismatch, f"{what}: {100 * frac:.2f}% of the elements differ from the reference"


def check_glue(op, backend, device, T, H, N, dtype, kind, *, gen, D=None, per_pos=1, proportional=False,
               strided=False, shifted=False, outs=True, call=None, down=None):
    """Run `op` on `backend` into poisoned out= buffers and compare every output with the oracle.
    down: rms_norm_gate_up with a down_weight [down, N] (the whole MLP: N is I).
    `call`: what runs the op instead of the public op (same arguments, without backend=): the CUDA
    kernels on the CPU emulator. strided: rows of x and the residual at strides H + 3 and H + 5;
    shifted: x one element into its storage (no 16-byte aligned rows)."""
    x, kw = make_prologue(T, H, dtype, kind, gen)
    if strided:  # row strides the ops accept: views into wider storage
        x = torch.cat([x, x[:, :3]], dim=1)[:, :H]
        if "residual" in kw:
            kw["residual"] = torch.cat([kw["residual"], kw["residual"][:, :5]], dim=1)[:, :H]
    if shifted:
        x = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(T, H)
    h_exact, n_exact = exact_prologue(x, kw, dtype)
    extra = {}
    if outs and "residual" in kw:
        extra["residual_out"] = poisoned((T, H), dtype, device)
    if op == "rms_norm_linear":
        w = weight(N, H, dtype, gen)
        if outs and "norm_weight" in kw:
            extra["normed_out"] = poisoned((T, H), dtype, device)
        out = poisoned((T, N), dtype, device)
        args = (w,)
        exact = exact_linear(n_exact, w, dtype)
    elif op == "rms_norm_gate_up":
        wg, wu = weight(N, H, dtype, gen), weight(N, H, dtype, gen)
        out = poisoned((T, N if down is None else down), dtype, device)
        args = (wg, wu)
        gate = rnd(exact_gelu_tanh(exact_linear(n_exact, wg, dtype)), dtype)
        exact = rnd(gate * exact_linear(n_exact, wu, dtype), dtype)
        if down is not None:
            wd = weight(down, N, dtype, gen)
            extra["down_weight"] = wd.to(device)
            exact = exact_linear(exact, wd, dtype)
    else:
        wq = weight(N, H, dtype, gen)
        qn = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
        positions = torch.randint(0, 40_000, (T // per_pos,), generator=gen)
        inv_freq = rope_inv_freq(D, proportional)
        out = poisoned((T, N // D, D), dtype, device)
        args = (wq, qn, positions, inv_freq)
        exact = exact_q_rope(n_exact, wq, qn, positions, inv_freq, dtype)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    run = call if call is not None else functools.partial(getattr(g, op), backend=backend)
    got = run(to(x), *map(to, args), eps=EPS, out=out, **{k: to(v) for k, v in kw.items()}, **extra)
    assert got is out
    ref_extra = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in extra.items() if k != "down_weight"}
    ref = getattr(g, op)(x, *args, eps=EPS, backend="torch", **kw, **ref_extra)
    if down is not None:
        # The down projection against this backend's own m (checked by the gate_up cases): one m element
        # flipped by an fp32 rounding upstream moves all of its token's outputs (fp16, T = 3: 67% of one
        # token's outputs differ from the reference's), a flip the oracle's tolerance allows.
        m = run(to(x), *map(to, args), eps=EPS, **{k: to(v) for k, v in kw.items()}).cpu()
        ref = (m.float() @ wd.float().T).to(dtype)
    what = f"{op} {backend} T={T} H={H} N={N} {dtype} {kind}"
    # With few tokens one flipped element of a token's normed input moves all of its outputs: on the
    # H200 (2026-12-04) the Triton q_rope of one token (H 1024, "layer") differed from the reference in
    # 8.94% of its 4096 outputs, exactly what the reference gives with its input norm's 1 / rms one fp32
    # ulp lower (an approximate rsqrt, another summation order). A misplaced rounding flips 25-33%.
    mismatch = 0.05 if T >= 8 else 0.15
    assert_matches(got, exact, ref, dtype, what, max_mismatch=mismatch)
    for name, exact_t in (("residual_out", h_exact), ("normed_out", n_exact)):
        if name in extra:
            assert_matches(extra[name], exact_t, ref_extra[name], dtype, f"{what} {name}", max_mismatch=mismatch)
    return got


def check_mlp_replays(backend: str) -> None:
    """The one-launch MLP on the GPU (E2B's shape, one token): its tree counters are cached, never memset,
    so each launch must leave them zero, or the next call or CUDA-graph replay would sum the wrong
    partials; repeated calls and replays must give the first call's output exactly."""
    d = DRAFTERS["E2B"]
    x, kw = make_prologue(1, d["Hd"], torch.bfloat16, "layer", torch.Generator().manual_seed(5))
    x, kw = x.cuda(), {k: v.cuda() for k, v in kw.items()}
    wg, wu = (weight(d["inter"], d["Hd"], torch.bfloat16, torch.Generator().manual_seed(s)).cuda() for s in (6, 7))
    wd = weight(d["Hd"], d["inter"], torch.bfloat16, torch.Generator().manual_seed(8)).cuda()

    def call():
        return g.rms_norm_gate_up(x, wg, wu, down_weight=wd, backend=backend, **kw)
    want = call()
    for _ in range(3):
        assert torch.equal(call(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        assert torch.equal(got, want)
