"""The `cuda` backend: the compiled extension `gemma4_mtp_kernels._C` (torch.ops.gemma4_mtp.*).

The extension is imported lazily, on first use, so that `import gemma4_mtp_kernels` works where it
was not built; `extension_status()` says why it is unusable when it is.

The functions below follow the backend contract (public signature minus `backend=`, arguments
already validated by gemma4_mtp_kernels.ops). They allocate the outputs the caller did not pass and
call the custom ops, which write them in place; the ops allocate their small workspaces from the
caching allocator, so the calls are safe inside CUDA-graph capture and under torch.compile.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .._checks import centroid_order
from .._types import VerifyResult

# The kernels' limits that the public ops do not impose (see csrc/include/gemma4_mtp/*.cuh).
MAX_CENTROIDS = 4096
DENSE_HEAD_SMEM = 48 * 1024  # 8 hidden rows staged in shared memory


# torch.compile evaluates this at trace time instead of tracing the import (the dispatcher calls it).
@torch.compiler.assume_constant_result
def extension_status() -> tuple[bool, str]:
    return _extension_status()


@functools.lru_cache(maxsize=None)
def _extension_status() -> tuple[bool, str]:
    try:
        importlib.import_module("gemma4_mtp_kernels._C")
    except ModuleNotFoundError:
        return False, f"the compiled extension gemma4_mtp_kernels._C is {_build_status()}"
    except (ImportError, OSError) as e:
        return False, f"the compiled extension failed to load, likely a torch version mismatch: {e}"
    from . import _fake  # noqa: F401  (registers the fake implementations once the ops exist)

    return True, "compiled extension gemma4_mtp_kernels._C"


def _build_status() -> str:
    """What setup.py recorded about the extension build ("not built because ...")."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_build_status.txt")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "not built (no build record: was the package installed with pip install?)"


_loaded = False


def _ops():
    # A plain flag, not the cached status call, once loaded: torch.compile traces through this.
    global _loaded
    if not _loaded:
        ok, reason = extension_status()
        if not ok:
            from .._dispatch import BackendUnavailableError

            raise BackendUnavailableError(f"backend 'cuda' is unavailable: {reason}")
        _loaded = True
    return torch.ops.gemma4_mtp


def _require_16_byte_rows(op: str, name: str, t: torch.Tensor, dims: int) -> None:
    """The attention kernels read q with 4- and 16-byte loads and copy K/V rows with 16-byte cp.async
    (sm_80) or bulk copies (sm_90): the data pointer and the strides of the first `dims` dimensions
    must be multiples of 16 bytes. The op checks the same in C++; checking here first refuses a bad
    layout with a ValueError before the extension is entered. Under torch.compile (and for fake
    tensors) there is no data pointer to read: the C++ check alone guards it there."""
    size, shape, strides = t.element_size(), t.shape, t.stride()
    if any(shape[i] > 1 and (strides[i] * size) % 16 for i in range(dims)):
        raise ValueError(f"{op}: {name} needs strides that are multiples of 16 bytes for the cuda backend, got "
                         f"strides {t.stride()} (element size {size}); use backend='triton' or 'torch' for this layout")
    if not torch.compiler.is_compiling() and not isinstance(t, FakeTensor) and t.data_ptr() % 16:
        raise ValueError(f"{op}: {name} needs a 16-byte aligned data pointer for the cuda backend, got one "
                         f"{t.data_ptr() % 16} bytes past a 16-byte boundary (storage offset {t.storage_offset()}, "
                         f"element size {size}); use backend='triton' or 'torch' for this layout")


# fused_concat_down_proj and centroid_logits need no layout check here: their launchers read rows with
# 16-byte loads only when data pointers and row strides allow it and take element-wise paths otherwise.
def fused_concat_down_proj(token_ids, embed_table, hidden, weight, *, embed_scale, out=None):
    if out is None:
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    _ops().fused_concat_down_proj(token_ids, embed_table, hidden, weight, float(embed_scale), out)
    return out


def q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=1.0, window=None, softcap=None,
                           out=None, return_lse=False):
    op = "q_only_paged_attention"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_16_byte_rows(op, name, t, 3)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _ops().q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens.contiguous(), float(scale),
                                  0 if window is None else int(window), 0.0 if softcap is None else float(softcap),
                                  out, lse)
    return (out, lse) if return_lse else out


def centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k=32, output="argmax", fill_value=None, k=1,
                    order=None):
    """order: phase 2's order forced ("tokens" or, for argmax and topk, "clusters"), for comparisons, as the
    Triton implementation takes it; None: the plan's (centroid_logic.h centroid_order)."""
    op = "centroid_logits"
    T = hidden.shape[0]
    C = centroids.shape[0]
    V = token_ordering.shape[0]
    if C > MAX_CENTROIDS:
        raise ValueError(f"{op}: centroids must have at most {MAX_CENTROIDS} rows for the cuda backend, got {C}")
    centroid_order(op, order, output)
    dev = hidden.device
    if output == "argmax":
        ids = torch.empty((T,), dtype=torch.int64, device=dev)
        logits = torch.empty((T,), dtype=torch.float32, device=dev)
    elif output == "topk":  # the op reads k from the shape of ids
        ids = torch.empty((T, k), dtype=torch.int64, device=dev)
        logits = torch.empty((T, k), dtype=torch.float32, device=dev)
    elif output == "sparse":
        K = top_k * (V // C)
        ids = torch.empty((T, K), dtype=torch.int64, device=dev)
        logits = torch.empty((T, K), dtype=torch.float32, device=dev)
    else:
        ids = torch.empty((0,), dtype=torch.int64, device=dev)
        logits = torch.full((T, V), fill_value, dtype=torch.float32, device=dev)
    _ops().centroid_logits(hidden, centroids, token_ordering, lm_head, int(top_k), output, ids, logits,
                           order or "auto")
    return logits if output == "dense" else (ids, logits)


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None):
    B, N, _ = target_logits.shape
    if draft_probs is not None and draft_probs.dtype not in (torch.float32, target_logits.dtype):
        draft_probs = draft_probs.float()  # exact; the kernel reads fp32 or the logits' dtype, at any alignment
    dev = target_logits.device
    accept_len = torch.empty((B,), dtype=torch.int32, device=dev)
    accepted = torch.empty((B, N), dtype=torch.int32, device=dev)
    tokens = torch.empty((B, N), dtype=torch.int64, device=dev)
    last = torch.empty((B,), dtype=torch.int32, device=dev)
    _ops().tree_verify(draft_tokens, parents, target_logits, temperature, uniforms, draft_probs,
                       accept_len, accepted, tokens, last)
    return VerifyResult(accept_len, accepted, tokens, last)


def dense_lm_head(hidden, lm_head, *, output="topk", k=1):
    op = "dense_lm_head"
    T, Hd = hidden.shape
    if 8 * Hd * hidden.element_size() > DENSE_HEAD_SMEM:
        raise ValueError(f"{op}: hidden must have at most {DENSE_HEAD_SMEM // (8 * hidden.element_size())} columns "
                         f"for the cuda backend, got {Hd}; use backend='triton'")
    dev = hidden.device
    empty = torch.empty((0, 0), dtype=torch.float32, device=dev)
    if output == "dense":
        dense = torch.empty((T, lm_head.shape[0]), dtype=torch.float32, device=dev)
        _ops().dense_lm_head(hidden, lm_head, 1, output, torch.empty((0, 0), dtype=torch.int64, device=dev), empty,
                             dense)
        return dense
    ids = torch.empty((T, k), dtype=torch.int64, device=dev)
    logits = torch.empty((T, k), dtype=torch.float32, device=dev)
    _ops().dense_lm_head(hidden, lm_head, int(k), output, ids, logits, empty)
    return ids, logits


# The fused glue ops: one kernel header (csrc/include/gemma4_mtp/rms_norm_linear.cuh). Rows read with
# 16-byte vectors take the tensor-core kernel, any other layout the CUDA-core one: no layout check here.
def rms_norm_linear(x, weight, *, norm_weight=None, eps=1e-6, residual=None, residual_norm_weight=None,
                    layer_scalar=None, out=None, residual_out=None, normed_out=None):
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _ops().rms_norm_linear(x, weight, norm_weight, float(eps), residual, residual_norm_weight, layer_scalar, out,
                           residual_out, normed_out)
    return out


def rms_norm_gate_up(x, gate_weight, up_weight, *, down_weight=None, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    # with down_weight the whole MLP: one launch at few tokens on the small drafters, else gate_up then
    # down_proj (the binding decides: glue_logic.h glue_mlp_one_launch)
    if out is None:
        N = gate_weight.shape[0] if down_weight is None else down_weight.shape[0]
        out = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    _ops().rms_norm_gate_up(x, gate_weight, up_weight, down_weight, norm_weight, float(eps), residual,
                            residual_norm_weight, layer_scalar, out, residual_out)
    return out


def rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, *, norm_weight=None, eps=1e-6, residual=None,
                    residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    D = q_norm_weight.shape[0]
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0] // D, D), dtype=x.dtype, device=x.device)
    _ops().rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, norm_weight, float(eps), residual,
                           residual_norm_weight, layer_scalar, out, residual_out)
    return out


def softmax_sample(logits, temperature, uniforms, *, probs_out=None):
    B, V = logits.shape
    probs = torch.empty((B, V), dtype=torch.float32, device=logits.device) if probs_out is None else probs_out
    tokens = torch.empty((B,), dtype=torch.int64, device=logits.device)
    _ops().softmax_sample(logits, temperature, uniforms, probs, tokens)
    return tokens, probs


def drafter_step(token_ids, hidden, embed_table, pre_projection, layer_weights, layer_kv, k_caches, v_caches,
                 block_tables, windows, seq_lens, positions, final_norm, post_projection, *, embed_scale, eps,
                 lm_head=None, centroids=None, token_ordering=None, centroid_top_k=0, k=1, temperature=None,
                 uniforms=None, probs_out=None):
    """A whole drafter step in one call (csrc/ops/drafter_step.cu): token_ids [B, Q], hidden [B, Q, Hb]
    -> (last [B, Q, Hd], proj [B, Q, Hb]), what Gemma4MTPDrafter.step computes from the ops.
    layer_weights: 12 tensors a layer (gemma4_mtp.drafter._LayerWeights' order), layer_kv: each layer's
    index into k_caches / v_caches / block_tables / windows (one entry per attention type; window 0:
    none). With lm_head, the LM head's k best tokens of last in the same call (Gemma4MTPDrafter.top_tokens:
    the centroid head with centroids, token_ordering and centroid_top_k, else the dense one): returns
    (last, proj, ids [B, Q, k] int64, scores [B, Q, k] fp32); with temperature [T] fp32 and uniforms [T]
    fp64 as well (T = B * Q), a token drawn per row instead (Gemma4MTPDrafter.sample_tokens: the head's
    dense logits, then softmax_sample): (last, proj, tokens [T] int64, q [T, V] fp32, into probs_out when
    given). Every argument is checked in C++ (a ValueError, or a TypeError for a dtype, naming it)."""
    B, Q = token_ids.shape
    Hb, Hd = hidden.shape[-1], pre_projection.shape[0]
    last = torch.empty((B, Q, Hd), dtype=hidden.dtype, device=hidden.device)
    proj = torch.empty((B, Q, Hb), dtype=hidden.dtype, device=hidden.device)
    ids = scores = probs = None
    sampled = temperature is not None
    if lm_head is not None:
        ids = torch.empty((B, Q, 1 if sampled else k), dtype=torch.int64, device=hidden.device)
        if not sampled:
            scores = torch.empty((B, Q, k), dtype=torch.float32, device=hidden.device)
        elif probs_out is None:
            probs = torch.empty((B * Q, lm_head.shape[0]), dtype=torch.float32, device=hidden.device)
        else:
            probs = probs_out
    # the layouts the op takes, copied only where a caller's differ (as the per-op step's calls accept them)
    _ops().drafter_step(token_ids.contiguous(), hidden.reshape(B * Q, Hb), embed_table, float(embed_scale),
                        pre_projection, layer_weights, layer_kv, k_caches, v_caches, block_tables, windows,
                        seq_lens.contiguous(), positions.contiguous(), final_norm, post_projection, float(eps),
                        centroids, token_ordering, lm_head, int(centroid_top_k), temperature, uniforms, last, proj,
                        ids, scores, probs)
    if lm_head is None:
        return last, proj
    return (last, proj, ids.view(B * Q), probs) if sampled else (last, proj, ids, scores)
