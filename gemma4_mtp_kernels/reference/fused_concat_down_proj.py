"""Reference `fused_concat_down_proj` (SPEC §4.1): the Gemma scaled embedding, concat, one matmul."""
import torch


def fused_concat_down_proj(token_ids, embed_table, hidden, weight, *, embed_scale, out=None):
    table_dtype = embed_table.dtype
    # Gemma's scaled embedding rounds the scale to the table dtype, then the product (in bf16,
    # sqrt(1536) = 39.19... becomes 39.25).
    scale = torch.tensor(embed_scale, dtype=table_dtype).float()
    emb = (embed_table[token_ids.long()].float() * scale).to(table_dtype)
    x = torch.cat([emb.float(), hidden.float()], dim=-1)
    y = (x @ weight.float().T).to(hidden.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
