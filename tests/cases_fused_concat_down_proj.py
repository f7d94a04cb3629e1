"""fused_concat_down_proj test inputs, fp64 oracle and the backend-vs-oracle check (all backends)."""
import math

import torch

from gemma4_mtp_kernels import fused_concat_down_proj
from helpers import assert_tolerance, poisoned


def exact_down_proj(token_ids, embed_table, hidden, weight, embed_scale):
    """fp64 oracle with the two table-dtype roundings of Gemma's scaled embedding kept."""
    table_dtype = embed_table.dtype
    scale = torch.tensor(embed_scale, dtype=table_dtype).double()
    emb = (embed_table[token_ids.long()].double() * scale).to(table_dtype).double()
    return torch.cat([emb, hidden.double()], dim=-1) @ weight.double().T


def make_inputs(T, Hb, Hd, dtype, V=97, g=None):
    token_ids = torch.randint(0, V, (T,), generator=g)
    embed_table = torch.randn(V, Hb, generator=g).to(dtype)
    hidden = torch.randn(T, Hb, generator=g).to(dtype)
    weight = (torch.randn(Hd, 2 * Hb, generator=g) / math.sqrt(2 * Hb)).to(dtype)
    return token_ids, embed_table, hidden, weight


def check_backend(backend, device, T, Hb, Hd, dtype, *, index_dtype=torch.int64, strided=False, V=97, g=None,
                  call=None):
    """`backend` on `device` into a poisoned out= buffer, against the fp64 oracle (SPEC §6 rule).
    `call`: what runs the op instead of the public op (same arguments, without backend=): the CUDA
    kernels on the CPU emulator."""
    token_ids, embed_table, hidden, weight = make_inputs(T, Hb, Hd, dtype, V=V, g=g)
    token_ids = token_ids.to(index_dtype)
    if strided:  # row strides the op accepts: views into wider storage (16-byte loads must not be assumed)
        embed_table = torch.cat([embed_table, embed_table[:, :3]], dim=1)[:, :Hb]
        hidden = torch.cat([hidden, hidden[:, :5]], dim=1)[:, :Hb]
    scale = math.sqrt(Hb)
    args = [t.to(device) for t in (token_ids, embed_table, hidden, weight)]
    out = poisoned((T, Hd), dtype, device)
    if call is None:
        got = fused_concat_down_proj(*args, embed_scale=scale, out=out, backend=backend)
    else:
        got = call(*args, embed_scale=scale, out=out)
    assert got is out
    exact = exact_down_proj(token_ids, embed_table, hidden, weight, scale)
    ref = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=scale, backend="torch")
    # fp32 results differ from the fp64 oracle only by summation order over 2*Hb terms
    atol = 1e-6 * math.sqrt(2 * Hb) * exact.abs().max().item() + 1e-6
    assert_tolerance(got.cpu(), exact, ref, atol=atol, what=f"T={T} Hb={Hb} Hd={Hd} {dtype} strided={strided}")
