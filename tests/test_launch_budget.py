"""The kernel launches of one eager drafter step, counted on CPU at the real shapes (issue 11).

`python -m benchmarks.launch_count` runs `Gemma4MTPDrafter.step` + `top_tokens` on meta tensors and
counts every launch a GPU would see: aten ops that launch kernels (a TorchDispatchMode) and Triton
launches (`gemma4_mtp_kernels.triton.record`). Meta tensors also make any host read of a device value
fail, so a step that is counted has no hidden sync. Before the fused glue a step launched 292 (E2B)
to 298 (31B) kernels by this count (~257 cudaLaunchKernel calls in the first GPU run's profile).

Budget per step: 6 per layer (q: 1; attention: 2, the split-KV partials and their merge; o_proj: 1;
gate/up: 1; down_proj: 1; for E2B / E4B one launch for both at T <= 4, `rms_norm_gate_up` with its
down_weight) + 3 (issue 11's aim): the pre-projection (1, its split-K reduced by its last
program), the post-projection with the final norm (1), the LM head (1: the centroid head, or the
dense head whose last program per token block merges the top-k lists), and no torch op at all, a
tree level's top-k included (each head ranks its candidates itself; the centroid head's tree levels
added 5 torch ops, sorting its 4096 candidates, before its output="topk").
A chain step's sliding layers take 5: their attention's splits are few and small (a 512-1024 key
window), and the attention kernel's last program of each row tile merges them (no merge launch).

Runs in a subprocess without TRITON_INTERPRET (counting needs the real @triton.jit kernels)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PER_LAYER, PER_STEP = 6, 3
# A decode round whose draft and target forward replay their graphs launches its bookkeeping from the
# host: the copies into the graphs' static buffers, tree_verify, the next round's pending tokens and
# hidden states (19 for a chain draft round of the embedded pair, 23 for a sampled chain round, 16
# target-only, at this budget's writing; 35 / 39 / 21 before the draft round's and the target forward's
# host inputs went over in one copy each), and a tree round's commit of an accepted path that moves
# (24 for a (2, 2, 1) tree round: one copy of the slot ids and a gather and a scatter per cache for the
# whole batch; counted from 2026-12-05, when it would have been 31: two copies and four index ops per
# cache and request).
EAGER_PER_REPLAYED_ROUND = 25


def _launch_count(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python_api"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "benchmarks.launch_count", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def counts():
    rows = _launch_count("--batch", "1", "8", "--queries", "1", "2", "--k", "1", "2")
    for r in rows:
        print(f"{r['drafter']:8s} B={r['B']} Q={r['Q']} k={r['k']}: {r['launches']} launches "
              f"({r['triton']} Triton, {r['torch']} torch: {r['torch_ops']})")
    return rows


def test_every_drafter_and_shape_is_counted(counts):
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS
    assert {(r["drafter"], r["B"], r["Q"], r["k"]) for r in counts} == {
        (n, B, Q, k) for n in DRAFTERS for B in (1, 8) for Q in (1, 2) for k in (1, 2)}


def test_a_chain_step_is_within_budget(counts):
    for r in counts:
        if r["k"] == 1:
            budget = PER_LAYER * r["layers"] + PER_STEP
            assert r["launches"] <= budget, f"{r['drafter']} B={r['B']} Q={r['Q']}: {r['launches']} > {budget}: {r}"
            assert r["torch"] == 0, f"{r['drafter']}: torch ops in a chain step: {r['torch_ops']}"


def test_a_chain_steps_sliding_layers_merge_in_the_attention_kernel(counts):
    for r in counts:
        if (r["Q"], r["k"]) == (1, 1):
            budget = PER_LAYER * r["layers"] - r["sliding_layers"] + PER_STEP
            assert r["sliding_layers"] == 3 and r["launches"] <= budget, r


def test_hugging_face_windows_launch_what_last_cached_ones_do(counts):
    """A chain step over Hugging Face's sliding windows (`query_position="next"`: 513 / 1025 keys, one more
    than the last-cached 512 / 1024) launches exactly what the last-cached step does: on E2B 513 keys would
    be 9 splits of two key tiles, one past what the in-kernel merge takes, and a merge launch per sliding
    layer; the launcher takes 6 splits of three tiles instead (triton/q_only_attention.fit_in_kernel_merge)."""
    rows = _launch_count("--query-position", "next")
    last_cached = {r["drafter"]: r for r in counts if (r["B"], r["Q"], r["k"]) == (1, 1, 1)}
    assert {r["drafter"] for r in rows} == set(last_cached)
    for r in rows:
        assert r["query_position"] == "next"
        assert r["triton_kernels"] == last_cached[r["drafter"]]["triton_kernels"], r


def test_a_one_request_steps_mlp_is_one_launch(counts):
    """At B = 1 (1 or 2 tokens a step) each layer's MLP (gate/up and down_proj) of E2B / E4B is one Triton
    launch; at B = 8 (8 or 16 tokens), and for 26B / 31B (`triton.rms_norm_gate_up.one_launch`), two."""
    for r in counts:
        one = r["B"] == 1 and r["drafter"] in ("E2B", "E4B")
        budget = PER_LAYER * r["layers"] + PER_STEP - (r["layers"] if one else 0)
        if (r["Q"], r["k"]) == (1, 1):
            budget -= r["sliding_layers"]
        assert r["launches"] <= budget, r


def test_the_stage_boundary_table_prices_a_chain_steps_launches(counts):
    """bench_stage_boundary's "x N" column is an E2B / E4B B = 1 chain step's dependent launches, as counted
    here (26B / 31B: 4 more, their MLPs in two launches)."""
    from benchmarks.bench_stage_boundary import STEP_STAGES
    steps = {r["drafter"]: r["launches"] for r in counts if (r["B"], r["Q"], r["k"]) == (1, 1, 1)}
    assert steps == {"E2B": STEP_STAGES, "E4B": STEP_STAGES, "26B-A4B": STEP_STAGES + 4, "31B": STEP_STAGES + 4}


def test_a_tree_level_is_within_budget(counts):
    """A tree level (Q queries of a request, top-k > 1): the chain step's budget, no torch op."""
    for r in counts:
        budget = PER_LAYER * r["layers"] + PER_STEP
        assert r["launches"] <= budget, f"{r['drafter']} B={r['B']} Q={r['Q']} k={r['k']}: {r['launches']} > {budget}"
        assert r["torch"] == 0, f"{r['drafter']} k={r['k']}: torch ops in a step: {r['torch_ops']}"


@pytest.fixture(scope="module")
def rounds():
    return _launch_count("--rounds", "--drafter", "E2B", "31B")


def test_a_chain_round_is_four_steps_and_a_verify(counts, rounds):
    """The round's bookkeeping (the pending token and each level's tokens written into [B, N]) adds a
    copy per level: a k = 4 chain round stays within 1.1x of four steps plus one tree_verify."""
    for r in rounds:
        if r["widths"] == [1, 1, 1, 1]:
            step = next(c["launches"] for c in counts if c["drafter"] == r["drafter"] and (c["B"], c["Q"], c["k"]) == (1, 1, 1))
            assert r["launches"] <= 1.1 * (4 * step + 1), r
            print(f"{r['drafter']} chain round: {r['launches']} launches = 4 x {step} + verify + {r['torch_ops']}")


def test_the_dense_head_has_no_fp32_copy_and_no_sort(counts):
    for r in counts:
        if "_head_kernel" in r["triton_kernels"]:
            assert not {"_to_copy", "sort", "mm"} & set(r["torch_ops"]), r


def test_host_time_is_reported_for_the_counted_step():
    """The eager host-time measurement (a benchmark number, not held to a bound here) runs the same
    step as the count: with Triton's launch path up to the driver (host_us), and without (host_ours_us);
    and with backend="cuda" where the extension is built: the step in one call (host_cuda_us) and the
    ops one by one (host_cuda_ops_us); a sampled step in one call (host_cuda_sampled_us) and as the step's
    call and the head's two (host_cuda_sampled_apart_us)."""
    from gemma4_mtp_kernels import cuda as cuda_backend

    (row,) = _launch_count("--host-time", "--drafter", "E2B")
    print(f"E2B B=1 eager step on this CPU: {row['host_us']} us, our side {row['host_ours_us']} us, "
          f"cuda backend {row['host_cuda_us']} us in one call, {row['host_cuda_ops_us']} us op by op; sampled "
          f"{row['host_cuda_sampled_us']} us in one call, {row['host_cuda_sampled_apart_us']} us in three")
    assert 0 < row["host_ours_us"] and 0 < row["host_us"], row
    for key in ("host_cuda_us", "host_cuda_ops_us", "host_cuda_sampled_us", "host_cuda_sampled_apart_us"):
        assert (row[key] is not None) == cuda_backend.extension_status()[0], row
        assert row[key] is None or row[key] > 0, row
    assert row["launches"] <= PER_LAYER * row["layers"] + PER_STEP, row


@pytest.fixture(scope="module")
def decode():
    return _launch_count("--decode")


def test_a_decode_round_waits_for_the_device_once(decode):
    """`speculative_generate` on meta tensors (launch_count --decode): every read of a device value
    raises there except the round's one result read (`speculative._read_round`), so reaching the end
    means no round read the device anywhere else; and no copy to the device is a blocking one (a
    blocking copy makes a CUDA host wait for the stream to drain, as a read does)."""
    assert [r["shape"] for r in decode] == [{"num_draft_tokens": 4}, {"tree": [2, 2, 1]}, {"num_draft_tokens": 0},
                                            {"num_draft_tokens": 4, "temperature": 0.8}]
    for r in decode:
        assert r["rounds"] == len(r["per_round"]) - 1 >= 5, r["shape"]  # round 0: the prefill
        for i, rnd in enumerate(r["per_round"]):
            assert rnd["h2d_blocking"] == 0, (r["shape"], i, rnd["blocking_at"])
            assert rnd["h2d_async"] > 0, (r["shape"], i)


def test_replayed_rounds_launch_little_from_the_host(decode):
    """Once a round's shapes are kept, its draft and target forward are graph replays; what the host
    still launches per round stays within EAGER_PER_REPLAYED_ROUND (the first such round also fills
    the new static buffers)."""
    for r in decode:
        replayed = [rnd for rnd in r["per_round"] if rnd["in_graphs"]][1:]
        assert len(replayed) >= 3, r["shape"]
        # from its second use (the first keeps the shapes) every round replays, the last ones too, which
        # the token budget cuts short (they used to run eagerly: a shape of their own each)
        assert all(rnd["in_graphs"] for rnd in r["per_round"][2:]), \
            (r["shape"], [x["in_graphs"] for x in r["per_round"]])
        for rnd in replayed:
            assert rnd["eager"] <= EAGER_PER_REPLAYED_ROUND, (r["shape"], rnd)
            print(f"{r['shape']}: {rnd['in_graphs']} launches in graphs, {rnd['eager']} from the host "
                  f"({rnd['eager_torch_ops']}), {rnd['h2d_async']} non-blocking copies")
