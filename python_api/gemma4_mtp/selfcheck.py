"""Runs each op through every available backend on small drafter-like inputs and compares it with the
torch reference. `python -m gemma4_mtp selfcheck` prints the table."""
from __future__ import annotations

import time

import torch


def _cases(device):
    g = torch.Generator().manual_seed(0)

    def rope_inv_freq(D):
        return (1.0 / 10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(device)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    T, Hb, Hd, V = 3, 256, 64, 512
    yield "fused_concat_down_proj", (
        torch.randint(0, V, (T,), generator=g).to(device), rnd(V, Hb), rnd(T, Hb), rnd(Hd, 2 * Hb) * 0.05,
    ), dict(embed_scale=Hb ** 0.5)

    B, Qn, Hq, Hkv, bs, D = 2, 2, 4, 2, 16, 256
    nb = 12
    seq = torch.tensor([37, 5], dtype=torch.int32, device=device)
    table = torch.randperm(nb, generator=g)[: 2 * 6].view(2, 6).to(torch.int32).to(device)
    yield "q_only_paged_attention", (
        rnd(B, Qn, Hq, D) * 0.1, rnd(nb, bs, Hkv, D), rnd(nb, bs, Hkv, D), table, seq,
    ), dict(window=24, return_lse=True)

    C, Vc = 16, 512
    yield "centroid_logits", (
        rnd(T, Hd), rnd(C, Hd), torch.randperm(Vc, generator=g).to(device), rnd(Vc, Hd),
    ), dict(top_k=4, output="argmax")

    N, Vv = 5, 300
    parents = torch.tensor([[-1, 0, 0, 1, 3]] * 2, dtype=torch.int32, device=device)
    logits = rnd(2, N, Vv, dtype=torch.float32)
    drafts = logits.argmax(-1).roll(1, dims=1)  # node i holds the target's choice at its parent: accepts
    yield "tree_verify", (drafts, parents, logits), dict(
        temperature=torch.tensor([0.0, 0.8], device=device),
        uniforms=torch.rand(2, N, 2, generator=g).to(device))

    # the fused glue of a drafter layer and the dense LM head (outputs O(1): bf16 steps of <= 1/128)
    H, I = 128, 96
    layer = dict(norm_weight=1 + 0.1 * rnd(H), residual=rnd(T, H), residual_norm_weight=1 + 0.1 * rnd(H),
                 layer_scalar=torch.tensor([0.5], dtype=torch.bfloat16, device=device))
    yield "rms_norm_linear", (rnd(T, H), rnd(Hd, H) * 0.05), layer
    yield "rms_norm_gate_up", (rnd(T, H), rnd(I, H) * 0.05, rnd(I, H) * 0.05), layer
    yield "rms_norm_q_rope", (
        rnd(T, H), rnd(2 * Hd, H) * 0.05, 1 + 0.1 * rnd(Hd), torch.tensor([5, 900, 31000], device=device),
        rope_inv_freq(Hd),
    ), dict(norm_weight=1 + 0.1 * rnd(H))
    yield "dense_lm_head", (rnd(T, Hd), rnd(V, Hd) * 0.1), dict(k=4)
    # a sampled draft token of two requests over three chunks of the kernels' 4096 ids
    yield "softmax_sample", (rnd(2, 9000, dtype=torch.float32) * 3, torch.tensor([0.7, 1.3], device=device),
                             torch.rand(2, generator=g, dtype=torch.float64).to(device)), {}


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)]


def run(device: str | None = None) -> list[tuple[str, str, str, str]]:
    import gemma4_mtp_kernels as K

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for op, args, kwargs in _cases(device):
        fn = getattr(K, op)
        ref = _flat(fn(*args, **kwargs, backend="torch"))
        for backend, status in K.available_backends().items():
            if backend == "torch":
                rows.append((op, backend, "ok", "reference"))
                continue
            if not status.available:
                rows.append((op, backend, "unavailable", status.detail))
                continue
            try:
                t0 = time.perf_counter()
                got = _flat(fn(*args, **kwargs, backend=backend))
                if got[0].is_cuda:
                    torch.cuda.synchronize()  # the first call's whole time (compile included), not its launch
                dt = time.perf_counter() - t0
            except Exception as e:  # the table reports it; nothing is hidden
                rows.append((op, backend, "ERROR", f"{type(e).__name__}: {e}"[:100]))
                continue
            err = max(((a.double() - b.double()).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0)
                      for a, b in zip(got, ref))
            exact = all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(got, ref))
            ok = exact and err <= 2e-2
            rows.append((op, backend, "ok" if ok else "MISMATCH", f"max |diff| {err:.2e}, {dt * 1e3:.0f} ms"))
    return rows


def main() -> int:
    """The table (on a machine without CUDA the Triton rows need TRITON_INTERPRET=1 set before the
    kernels are imported: `python -m gemma4_mtp selfcheck` sees to it)."""
    rows = run()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'op':{widths[0]}}  {'backend':{widths[1]}}  {'status':{widths[2]}}  detail")
    for r in rows:
        print(f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]:{widths[2]}}  {r[3]}")
    return 0 if all(r[2] in ("ok", "unavailable") for r in rows) else 1
