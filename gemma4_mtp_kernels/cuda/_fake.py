"""Fake (meta) implementations of torch.ops.gemma4_mtp.*, so torch.compile(fullgraph=True) and
FakeTensorMode trace the ops. Every op writes only its mutable arguments (Tensor(a!) in the schema)
and returns nothing, so the fakes only have to exist and return None."""
import torch


@torch.library.register_fake("gemma4_mtp::fused_concat_down_proj")
def _fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale, out):
    return None


@torch.library.register_fake("gemma4_mtp::q_only_paged_attention")
def _q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, out, lse):
    return None


@torch.library.register_fake("gemma4_mtp::centroid_logits")
def _centroid_logits(hidden, centroids, token_ordering, lm_head, top_k, output, ids, logits, order="auto"):
    return None


@torch.library.register_fake("gemma4_mtp::tree_verify")
def _tree_verify(draft_tokens, parents, target_logits, temperature, uniforms, draft_probs, accept_len,
                 accepted_nodes, output_tokens, last_node):
    return None


@torch.library.register_fake("gemma4_mtp::dense_lm_head")
def _dense_lm_head(hidden, lm_head, k, output, ids, logits, dense):
    return None


@torch.library.register_fake("gemma4_mtp::rms_norm_linear")
def _rms_norm_linear(x, weight, norm_weight, eps, residual, residual_norm_weight, layer_scalar, out, residual_out,
                     normed_out):
    return None


@torch.library.register_fake("gemma4_mtp::rms_norm_gate_up")
def _rms_norm_gate_up(x, gate_weight, up_weight, down_weight, norm_weight, eps, residual, residual_norm_weight,
                      layer_scalar, out, residual_out):
    return None


@torch.library.register_fake("gemma4_mtp::rms_norm_q_rope")
def _rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, norm_weight, eps, residual, residual_norm_weight,
                     layer_scalar, out, residual_out):
    return None


@torch.library.register_fake("gemma4_mtp::softmax_sample")
def _softmax_sample(logits, temperature, uniforms, probs, tokens):
    return None


@torch.library.register_fake("gemma4_mtp::drafter_step")
def _drafter_step(token_ids, hidden, embed_table, embed_scale, pre_projection, layer_weights, layer_kv, k_caches,
                  v_caches, block_tables, windows, seq_lens, positions, final_norm, post_projection, eps, centroids,
                  token_ordering, lm_head, centroid_top_k, temperature, uniforms, last, proj, ids, scores, probs):
    return None
