"""Hugging Face assisted generation with and without `gemma4_mtp.hf.accelerate`, at a real drafter
shape with random weights.

    python -m benchmarks.bench_hf_assisted --out hf.json                 # GPU: E2B-shaped, bf16, timed
    python -m benchmarks.bench_hf_assisted --drafter 31B --out hf31.json
    python -m benchmarks.bench_hf_assisted --dry-run --out dry.json      # CPU: tiny shapes, fp32, no timing

Two measurements per assistant (plain Hugging Face, then accelerated with each backend):
- `generate`: `target.generate(prompt, assistant_model=...)` greedy, tokens/s (wall clock between
  CUDA syncs, median of --repeats after a warm-up run that also JIT-compiles the Triton kernels);
  the drafts per round are fixed (`num_assistant_tokens`, constant schedule). Random weights accept
  almost no drafts, so a round is k assistant forwards + one target forward for about one token:
  the ratio between assistants is what this measures, not the speed-up over target-only decoding a
  trained drafter brings. `target_only` (generate without assistant) is listed for scale.
- `assistant_forward`: one assistant forward as the candidate generator calls it (B = 1, one
  position, the target's shared K/V at the prompt's context), eager, CUDA events (benchmarks.timer).
The target is Gemma4ForCausalLM at the drafter's backbone width (drafter_shapes.DRAFTERS: hidden,
KV heads, head dims, window, vocab; MLP 4x hidden; --target-layers layers, sliding x 3 + full),
without per-layer embeddings, so it is the cheapest target such a drafter could serve: the
assistant's share of a round is as large as it gets here. Each run's tokens are recorded; in the dry
run every one must equal a greedy loop that recomputes the target's forward over the whole sequence
(the test checks it), on the GPU (bf16) equality with plain HF is reported, not required.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # python benchmarks/bench_hf_assisted.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

DRY = dict(Hb=64, Hd=32, inter=64, Hq=4, Hkv_swa=2, Hkv_full=1, D_swa=64, D_full=128, window=8, centroids=16,
           top_k=4, vocab=128)
LAYERS = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")


def _text_config(s, *, hidden, inter, layers, eos):
    from transformers import Gemma4TextConfig
    k_eq_v = s["Hkv_full"] != s["Hkv_swa"]
    cfg = Gemma4TextConfig(
        vocab_size=s["vocab"], hidden_size=hidden, intermediate_size=inter, num_hidden_layers=len(layers),
        num_attention_heads=s["Hq"], num_key_value_heads=s["Hkv_swa"], head_dim=s["D_swa"],
        global_head_dim=s["D_full"], num_global_key_value_heads=s["Hkv_full"] if k_eq_v else None,
        attention_k_eq_v=k_eq_v, sliding_window=s["window"], layer_types=list(layers),
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
        tie_word_embeddings=True, eos_token_id=eos, pad_token_id=0, bos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(s, *, target_layers, device, dtype, seed):
    """(target, plain assistant) with random weights at shape s (a drafter_shapes.DRAFTERS entry)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM
    torch.manual_seed(seed)
    layers = (LAYERS * target_layers)[:target_layers - 1] + ("full_attention",)
    ordered = s["centroids"] is not None
    with torch.device(device):
        target = Gemma4ForCausalLM(_text_config(s, hidden=s["Hb"], inter=4 * s["Hb"], layers=layers, eos=None))
        acfg = Gemma4AssistantConfig(text_config=_text_config(s, hidden=s["Hd"], inter=s["inter"], layers=LAYERS,
                                                              eos=None),
                                     backbone_hidden_size=s["Hb"], use_ordered_embeddings=ordered,
                                     num_centroids=s["centroids"] or 2048, centroid_intermediate_top_k=s["top_k"] or 32)
        acfg._attn_implementation = "sdpa"
        assistant = Gemma4AssistantForCausalLM(acfg)
    with torch.no_grad():
        for m in (target, assistant):  # O(1) activations: HF's 0.02 init makes every logit nearly equal
            for name, p in m.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.normal_(0.0, p.shape[1] ** -0.5)
        if ordered:  # HF initialises the ordering to zeros; a checkpoint holds a permutation
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(s["vocab"], device=device))
    target, assistant = target.to(dtype).eval(), assistant.to(dtype).eval()
    return target, assistant


def recompute_greedy(target, prompt, n):
    """Target-only greedy over the target's forward on the whole sequence (the dry run's oracle)."""
    import torch
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids[None]).logits[0, -1].argmax()[None]])
    return ids


def _assistants(plain, backends):
    from gemma4_mtp.hf import accelerate
    from gemma4_mtp_kernels import BackendUnavailableError
    out = {"hf_assistant": (plain, None)}
    for b in backends:
        try:
            out[f"accelerated_{b}"] = (accelerate(copy.deepcopy(plain), backend=b), None)
        except BackendUnavailableError as e:
            out[f"accelerated_{b}"] = (None, str(e))
    return out


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(*, dry: bool, drafter: str, out_path: str, context: int, new_tokens: int, drafts: int, repeats: int,
        target_layers: int, log=print) -> dict:
    import torch

    from gemma4_mtp_kernels import BackendUnavailableError
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    from . import timer
    from .run_all import environment, write_json
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    s = DRY if dry else DRAFTERS[drafter]
    target, plain = build(s, target_layers=target_layers, device=device, dtype=dtype, seed=0)
    for m in (plain,):
        m.generation_config.num_assistant_tokens = drafts
        m.generation_config.num_assistant_tokens_schedule = "constant"
    backends = ("torch", "triton") if dry else ("auto", "triton", "cuda")
    prompt = torch.randint(3, s["vocab"], (context,), generator=torch.Generator().manual_seed(1)).to(device)
    res = {"schema": 1, "dry_run": dry, "dtype": str(dtype).replace("torch.", ""), "env": environment(torch),
           "config": {"drafter": "tiny (dry run)" if dry else drafter, "shape": s, "context": context,
                      "new_tokens": new_tokens, "drafts_per_round": drafts, "target_layers": target_layers,
                      "repeats": repeats},
           "runs": [], "assistant_forward": []}
    reference = recompute_greedy(target, prompt, new_tokens)[context:].tolist() if dry else None
    res["reference"] = "recompute greedy" if dry else "target_only"
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    entries = {"target_only": (None, None), **_assistants(plain, backends)}
    for name, (assistant, missing) in entries.items():
        r = {"assistant": name}
        if missing:
            r.update(status="missing", reason=missing)
            res["runs"].append(r)
            continue
        counts = {"target": 0, "assistant": 0}
        hooks = [target.register_forward_hook(lambda *a: counts.__setitem__("target", counts["target"] + 1))]
        if assistant is not None:
            hooks.append(assistant.register_forward_hook(
                lambda *a: counts.__setitem__("assistant", counts["assistant"] + 1)))
        try:
            extra = {} if assistant is None else {"assistant_model": assistant}
            times = []
            for i in range(1 if dry else repeats + 1):  # GPU: the first run warms up (Triton JIT)
                counts.update(target=0, assistant=0)
                _sync(device)
                t0 = time.perf_counter()
                out = target.generate(prompt[None], **kw, **extra)[0, context:]
                _sync(device)
                if i or dry:
                    times.append(time.perf_counter() - t0)
            r.update(status="ok", tokens=out.tolist(), new_tokens=out.numel(), target_forwards=counts["target"],
                     assistant_calls=counts["assistant"])
            if not dry:
                r.update(time_s=statistics.median(times), tokens_per_s=out.numel() / statistics.median(times))
        except BackendUnavailableError as e:
            r.update(status="missing", reason=str(e))
        except Exception as e:  # noqa: BLE001 - a failing run is a result
            r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            for h in hooks:
                h.remove()
        if reference is None and name == "target_only" and r["status"] == "ok":
            reference = r["tokens"]
        if r["status"] == "ok":
            r["matches_reference"] = r["tokens"] == reference
        res["runs"].append(r)
        timed = f"{r['tokens_per_s']:8.1f} tok/s" if "tokens_per_s" in r else r.get("reason", "")
        log(f"generate {name:22s} {r['status']:8s} {timed}")
        write_json(res, out_path)
    base = next(r for r in res["runs"] if r["assistant"] == "hf_assistant")
    for r in res["runs"]:
        if r.get("time_s") and base.get("time_s"):
            r["speedup_vs_hf_assistant"] = base["time_s"] / r["time_s"]

    with torch.no_grad():
        tout = target(prompt[None], output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    inputs = dict(inputs_embeds=torch.cat([target.get_input_embeddings()(prompt[None, -1:]),
                                           tout.hidden_states[-1][:, -1:]], dim=-1),
                  attention_mask=torch.ones(1, context, dtype=torch.long, device=device),
                  position_ids=torch.tensor([[context - 1]], device=device),
                  shared_kv_states=tout.shared_kv_states, use_cache=False)
    for name, (assistant, missing) in entries.items():
        if assistant is None:
            continue
        r = {"assistant": name}
        try:
            with torch.no_grad():
                assistant(**inputs)
                if not dry:
                    r.update(timer.time_calls([lambda: assistant(**inputs)], runs=30, graph=False).to_dict())
            r["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
        res["assistant_forward"].append(r)
        timed = f"{1e3 * r['time_s']:8.3f} ms" if "time_s" in r else r.get("reason", "")
        log(f"forward  {name:22s} {r['status']:8s} {timed}")
    write_json(res, out_path)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="HF assisted generation with and without gemma4_mtp.hf.accelerate")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "hf_assisted.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, fp32, every path except timing")
    p.add_argument("--drafter", default="E2B", help="a drafter_shapes.DRAFTERS key (GPU runs)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 2048; dry run 19)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; dry run 8)")
    p.add_argument("--drafts", type=int, default=4, help="assistant tokens per round (constant schedule)")
    p.add_argument("--repeats", type=int, default=3, help="timed generate runs per assistant (median)")
    p.add_argument("--target-layers", type=int, default=4)
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch
        if not torch.cuda.is_available():
            print("bench_hf_assisted: no GPU (torch.cuda.is_available() is False); use --dry-run on a CPU machine",
                  file=sys.stderr)
            return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    run(dry=args.dry_run, drafter=args.drafter, out_path=args.out,
        context=args.context or (19 if args.dry_run else 2048),
        new_tokens=args.new_tokens or (8 if args.dry_run else 64), drafts=args.drafts, repeats=args.repeats,
        target_layers=args.target_layers, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
