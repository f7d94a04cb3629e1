"""Reference `q_only_paged_attention` (SPEC §4.2): gather the attended keys request by request."""
import torch


def q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=1.0, window=None, softcap=None,
                           out=None, return_lse=False):
    B, Qn, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    o = torch.zeros(B, Qn, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Qn, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        length = int(seq_lens[b])
        start = max(0, length - window) if window is not None else 0
        if length <= start:
            continue
        pos = torch.arange(start, length, device=q.device)
        blocks = block_table[b, pos // block_size].long()
        slots = pos % block_size
        # query head h reads KV head h // group
        k = k_cache[blocks, slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[blocks, slots].float().repeat_interleave(group, dim=1)
        s = scale * torch.einsum("qhd,nhd->qhn", q[b].float(), k)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        lse[b] = torch.logsumexp(s, dim=-1)
        o[b] = torch.einsum("qhn,nhd->qhd", torch.softmax(s, dim=-1), v)
    if out is None:
        out = o.to(q.dtype)
    else:
        out.copy_(o)
    return (out, lse) if return_lse else out
