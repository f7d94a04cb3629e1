"""Every Triton launch the launchers make compiles ahead of time for sm_80 and sm_90 (no GPU needed),
under Triton 3.8 (torch 2.14) and Triton 3.6 (torch 2.11, the GPU image and many engine installs).

The launches are not described here: `gemma4_mtp_kernels.triton.aot` runs the public ops over the real
drafter shapes and the awkward cases on meta tensors and records what the launchers launch, as Triton's
JIT specialises it (`gemma4_mtp_kernels.triton.record`). Each distinct launch must compile, fit the
shared memory of an A100 / H100 block (a launch over it fails on the GPU) and, for bf16/fp16, not spill
(aot.STACK_SLOT_BYTES: one saved predicate slot is allowed).

Each launch with float scalars is checked once more, typed as torch.compile types them (fp64), in Triton's
front end (`aot.INDUCTOR_FLOAT`).

The compiles run in a subprocess (the launches recorded once, compiled in two worker processes): under
TRITON_INTERPRET=1 (set for the CPU tests) the kernels are interpreter objects that cannot be compiled.
Triton 3.6 is the second environment `.ci/setup` installs into `.triton36/` (triton only; torch and the
project from `.venv`).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRITON36 = ROOT / ".triton36"


def _compile_all(extra_path: pathlib.Path | None) -> tuple[str, list[dict], list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT), env.get("PYTHONPATH", "")])
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    kernels = json.loads(subprocess.run([sys.executable, "-m", "gemma4_mtp_kernels.triton.aot", "--kernels"], env=env,
                                        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    # the launches are recorded once and compiled in two processes (this machine's and CI's two cores)
    proc = subprocess.run([sys.executable, "-m", "gemma4_mtp_kernels.triton.aot", "--jobs", "2"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=4800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    return version, rows, kernels


@pytest.fixture(scope="module", params=["3.8", "3.6"])
def compiled(request):
    if request.param == "3.6":
        if not (TRITON36 / "triton").is_dir():
            pytest.fail(f"no Triton 3.6 environment at {TRITON36}: `bash .ci/setup` installs it")
        version, rows, kernels = _compile_all(TRITON36)
    else:
        version, rows, kernels = _compile_all(None)
    assert version.startswith(request.param), f"expected triton {request.param}, the environment has {version}"
    return rows, set(kernels)


def test_every_recorded_launch_compiles_fits_and_does_not_spill(compiled):
    compiled, _ = compiled
    bad = [f"{r['name']} {r['arch']}: {'; '.join(r['problems'])}" for r in compiled if r["problems"]]
    assert not bad, f"{len(bad)} of {len(compiled)} compiles:\n" + "\n".join(bad[:40])
    assert all(0 < r["registers"] <= 255 for r in compiled if r["stage"] == "cubin")


def test_every_launch_with_float_scalars_is_checked_as_torch_compile_launches_it(compiled):
    """Each sm_90 launch with fp32 scalars has a twin typed as inductor types them (aot.INDUCTOR_FLOAT), taken
    through Triton's front end (stage "ttir"), the launch's own compile being the cubin row."""
    from gemma4_mtp_kernels.triton import aot

    compiled, _ = compiled
    assert {r["stage"] for r in compiled} == {"cubin", "ttir"}

    def key(r, scalar):
        return r["kernel"], json.dumps(r["constexprs"], sort_keys=True), r["num_warps"], r["num_stages"], \
            json.dumps({k: scalar if v in ("fp32", aot.INDUCTOR_FLOAT) else v for k, v in r["signature"].items()},
                       sort_keys=True)

    ttir = [r for r in compiled if r["stage"] == "ttir"]
    assert all(r["arch"] == "sm_90" and aot.INDUCTOR_FLOAT in r["signature"].values() for r in ttir)
    with_floats = [r for r in compiled if r["stage"] == "cubin" and r["arch"] == "sm_90"
                   and "fp32" in r["signature"].values()]
    assert {r["kernel"] for r in ttir} == {r["kernel"] for r in with_floats} >= {"_attn_kernel", "_q_rope_kernel"}
    twins = {key(r, "f") for r in with_floats}
    assert all(key(r, "f") in twins for r in ttir)


def test_every_kernel_is_recorded_for_both_archs(compiled):
    """Each Triton kernel the package defines (and launches) is launched by some scenario."""
    compiled, kernels = compiled
    assert len(kernels) >= 5
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in compiled if r["arch"] == arch} == kernels


def test_the_awkward_paths_are_recorded(compiled):
    """The scenarios reach the paths that matter: split and single-launch attention, split-K and direct
    down_proj, every centroid output, every dtype, and tree_verify greedy (no temperature: None
    pointers), sampling and draft-probability launches."""
    compiled, _ = compiled
    names = {r["kernel"]: [] for r in compiled}
    for r in compiled:
        names[r["kernel"]].append(r)
    attn = names["_attn_kernel"]
    assert {r["dtype"] for r in attn} == {"bf16", "fp16", "fp32"}
    assert any(r["constexprs"].get("PARTIAL") is True for r in attn)
    assert any(r["constexprs"].get("PARTIAL") is False for r in attn)
    assert any(r["constexprs"].get("HAS_SOFTCAP") is True for r in attn)
    down = names["_down_proj_kernel"]
    assert any(r["signature"].get("part_ptr") == "*fp32" for r in down)  # split-K partials
    assert any("part_ptr" in r["none_args"] for r in down)  # the direct store
    head = names["_head"]
    assert {r["constexprs"]["OUTPUT"] for r in head} == {"argmax", "topk", "sparse", "dense"}
    assert {r["constexprs"]["OUT_K2"] for r in head if r["constexprs"]["OUTPUT"] == "topk"} == {2, 16}
    # phase 2 in both orders (T = 1: token-major; T = 8, 64: cluster-major), each argmax and topk (k 2, 16)
    assert {(r["constexprs"]["CLUSTER_MAJOR"], r["constexprs"]["OUTPUT"], r["constexprs"]["OUT_K2"]) for r in head
            if r["constexprs"]["OUTPUT"] in ("argmax", "topk")} == {(m, "argmax", 2) for m in (False, True)} | {
                (m, "topk", k) for m in (False, True) for k in (2, 16)}
    verify = names["_verify"]
    greedy = [r for r in verify if r["constexprs"]["HAS_TEMP"] is False]
    # greedy launches: the sampling pointers are None (the first GPU run's compile failure)
    assert greedy and all({"q_ptr", "temp_ptr", "unif_ptr"} <= set(r["none_args"]) for r in greedy)
    assert any(r["constexprs"]["HAS_TEMP"] and not r["constexprs"]["HAS_DRAFT"] for r in verify)
    assert any(r["constexprs"]["HAS_DRAFT"] for r in verify)
    # the fused glue: split-K fixups and direct stores, each prologue, both head outputs
    linear = names["_norm_linear_kernel"]
    assert {r["constexprs"]["SPLIT"] for r in linear} == {True, False}
    assert any(r["constexprs"]["HAS_RES"] and r["constexprs"]["WRITE_N"] for r in linear)  # post_projection
    q = names["_q_rope_kernel"]
    assert {r["constexprs"]["D"] for r in q} == {256, 512} and {r["constexprs"]["HAS_RES"] for r in q} == {True, False}
    assert {r["constexprs"]["DENSE"] for r in names["_head_kernel"]} == {True, False}


def test_split_k_epilogues_load_their_partials_at_once(compiled):
    """The decode steps' split-K launches on sm_90 (rms_norm_linear, fused_concat_down_proj at token tiles
    <= 16, the one-launch MLP's group sums, with the 128-register cap) issue a group of partial loads
    before any add: one wave in the SASS after the election (the row's problem otherwise), where a
    tile-at-a-time loop made one dependent L2 round trip per split."""
    compiled, _ = compiled
    rows = [r for r in compiled if "split_load_waves" in r]
    assert {r["kernel"] for r in rows} == {"_norm_linear_kernel", "_down_proj_kernel", "_mlp_kernel"}
    assert all(r["split_load_waves"] == 1 for r in rows)


def test_in_kernel_merges_load_their_partials_with_the_lse(compiled):
    """The attention launches on sm_90 whose last program merges the splits (the sliding layers of a
    step) load every lse and partial in one wave after the election, not the partials after the lse's
    reduction (a second dependent L2 round trip)."""
    compiled, _ = compiled
    rows = [r for r in compiled if "merge_load_waves" in r]
    assert rows and {r["kernel"] for r in rows} == {"_attn_kernel"}
    assert all(r["merge_load_waves"] == 1 for r in rows), [(r["name"], r["merge_load_waves"]) for r in rows]


def test_step_sass_lists_every_launch_of_a_step():
    """aot.step_sass (the step table of benchmarks/triton_resources.md): the 20 launches of an E2B step at
    B = 1 in launch order, from the pre-projection to the centroid head, each with its sm_90 SASS counts;
    the elected tails where a counter elects a program (q_rope's one-token epilogue, the one-launch MLP's
    reduction tree among them)."""
    from gemma4_mtp_kernels.triton import aot

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python_api"), env.get("PYTHONPATH", "")])
    rows = json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from gemma4_mtp_kernels.triton.aot import step_sass; "
                               "print(json.dumps(step_sass('E2B')))"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    kernels = [r["kernel"] for r in rows]
    assert len(rows) == 20 and kernels[0] == "_down_proj_kernel" and kernels[-1] == "_head"
    assert kernels.count("_q_rope_kernel") == kernels.count("_mlp_kernel") == 4 and "_gate_up_kernel" not in kernels
    assert all(r["instructions"] > r["barriers"] > 0 and r["global_loads"] > 0 for r in rows)
    assert all(0 < r["after_election"] <= aot.Q_ROPE_ONE_TOKEN_TAIL for r in rows if r["kernel"] == "_q_rope_kernel")
    assert all(r["after_election"] > 0 for r in rows if r["kernel"] == "_mlp_kernel")


def test_q_rope_one_token_epilogue_is_short(compiled):
    """q_rope's elected program (q_norm + RoPE of a head, alone on the critical path) at T = 1 on sm_90
    computes one token: its SASS after the election stays under aot.Q_ROPE_ONE_TOKEN_TAIL instructions
    (~200-280), where the 2048 / D-token tile of larger T takes ~700."""
    from gemma4_mtp_kernels.triton import aot

    compiled, _ = compiled
    rows = [r for r in compiled if r["kernel"] == "_q_rope_kernel" and r["arch"] == "sm_90" and r["stage"] == "cubin"
            and not r["problems"]]
    one = [r["elected_instructions"] for r in rows if r["constexprs"]["EPI_T"] == 1]
    many = [r["elected_instructions"] for r in rows if r["constexprs"]["EPI_T"] > 1 and r["dtype"] != "fp32"]
    assert one and many
    assert max(one) <= aot.Q_ROPE_ONE_TOKEN_TAIL < min(many), (one, many)


# The kernels of a drafter step launched with programmatic dependent launch on sm_90 (`_common.pdl_args`),
# a sampled step's softmax_sample included. Not the centroid head (a cooperative launch: its grid barrier
# needs every program resident) nor tree_verify (once per round, after the target's forward).
PDL_KERNELS = {"_attn_kernel", "_merge_kernel", "_down_proj_kernel", "_q_rope_kernel", "_norm_linear_kernel",
               "_gate_up_kernel", "_mlp_kernel", "_head_kernel", "_chunk_stats_kernel", "_probs_kernel"}
# the step's weight streams (the glue and the pre-projection), which prefetch before their wait
PREFETCH_KERNELS = {"_down_proj_kernel", "_q_rope_kernel", "_norm_linear_kernel", "_gate_up_kernel", "_mlp_kernel"}


def test_programmatic_dependent_launch_on_sm90_only(compiled):
    """Every sm_90 launch of the step kernels is a programmatic dependent launch that waits before it
    touches global memory (the compile rows' PTX check, in test above); no sm_80 launch is, and the
    kernels whose programs wait on each other never are."""
    compiled, kernels = compiled
    assert PDL_KERNELS <= kernels
    late = set()
    for r in (r for r in compiled if r["stage"] == "cubin"):
        want = r["arch"] == "sm_90" and r["kernel"] in PDL_KERNELS
        use = r["constexprs"].get("USE_PDL", 0)
        assert r["pdl"] is want and bool(use) is want, (r["name"], r["arch"])
        # USE_PDL 1 triggers the next kernel once its own wait is over, 2 leaves it to the kernel's exit
        assert r["pdl_early_trigger"] is (use % 4 == 1), (r["name"], r["arch"], use)
        if use % 4 == 2:
            late.add(r["kernel"])
        # + 4: the GEMV kernels prefetch their first weight lines into L2 before the wait, and only they
        assert (use >= 4) is (want and r["kernel"] in PREFETCH_KERNELS), (r["name"], r["arch"], use)
        prefetches = r.get("prefetches_before_wait", 0)  # a launch that does not compile fails the test above
        assert (prefetches > 0) is (use >= 4), (r["name"], r["arch"], prefetches)
    assert late == PDL_KERNELS, late  # the PDL-at-exit step scenarios of aot


def test_the_pdl_check_finds_an_early_global_access():
    """aot.pdl_problem, the PTX check behind the compile rows, on hand-written PTX."""
    from gemma4_mtp_kernels.triton.aot import pdl_problem

    ok = "mov.u32 %r1, %ctaid.x;\nld.param.u64 %rd1, [p];\ngriddepcontrol.wait;\nld.global.b32 %r2, [%rd1];\n"
    assert pdl_problem(ok) is None
    assert "before griddepcontrol.wait" in pdl_problem("@%p1 ld.global.b32 %r2, [%rd1];\n" + ok)
    assert "before griddepcontrol.wait" in pdl_problem("cp.async.cg.shared.global [%r1], [%rd1], 16;\n" + ok)
    assert "before griddepcontrol.wait" in pdl_problem("\tatom.global.add.u32 %r3, [%rd2], 1;\n" + ok)
    # an L2 prefetch of global memory may come first (prefetch_weight_rows); any other prefetch may not
    assert pdl_problem("\tprefetch.global.L2 [%rd4];\n" + ok) is None
    assert "before griddepcontrol.wait" in pdl_problem("\tprefetch.global.L1 [%rd4];\n" + ok)
    assert "before griddepcontrol.wait" in pdl_problem("\tprefetch.L2 [%rd4];\n" + ok)
    assert "never waits" in pdl_problem("ld.param.u64 %rd1, [p];\n")


# The TTIR of a kernel whose fp64 scalars (as torch.compile types them) are cast before use: the shape of
# Triton's output (3.6 and 3.8), cut down.
_TTIR = """module {
  tt.func public @_k(%x_ptr: !tt.ptr<bf16> {tt.divisibility = 16 : i32} loc("x_ptr"(#loc)), \
%scale: f64 loc("scale"(#loc)), %scale2: f64 loc("scale2"(#loc)), %n: i32 loc("n"(#loc))) attributes {noinline = false} {
    %scale_0 = arith.truncf %scale : f64 to f32 loc(#loc2)
    %scale2_1 = arith.truncf %scale2 : f64 to f32 loc(#loc3)
    %0 = tt.splat %scale_0 : f32 -> tensor<16xf32> loc(#loc4)
    %fd = arith.extf %0 : tensor<16xf32> to tensor<16xf64> loc(#loc5)
    tt.return loc(#loc6)
  } loc(#loc)
} loc(#loc)
"""


def test_the_torch_compile_check_finds_an_uncast_float_scalar():
    """aot.uncast_float_scalars, the check behind the "ttir" rows, on hand-written TTIR: fp64 arithmetic of
    the kernel's own (the extf above) is not a scalar's; a scalar used before (or without) its cast is."""
    from gemma4_mtp_kernels.triton.aot import uncast_float_scalars

    assert uncast_float_scalars(_TTIR) == []
    used = _TTIR.replace("    tt.return", "    %1 = tt.splat %scale2 : f64 -> tensor<16xf64> loc(#loc7)\n    tt.return")
    assert uncast_float_scalars(used) == ["scale2"]
    uncast = _TTIR.replace("    %scale_0 = arith.truncf %scale : f64 to f32 loc(#loc2)\n", "").replace(
        "tt.splat %scale_0 : f32 -> tensor<16xf32>", "tt.splat %scale : f64 -> tensor<16xf64>")
    assert uncast_float_scalars(uncast) == ["scale"]
    assert uncast_float_scalars(_TTIR.replace(": f64 to f32", ": f64 to f16")) == ["scale", "scale2"]


# Distinct compiles of a drafter's chain steps over batch sizes 1-16 and five context lengths (1K-70K):
# attention one per layer type and split / unsplit path, its merge one per head dim, the glue one per
# token block (16 / 32 / 64 tokens) and split-K choice. Before the sizes were left unspecialised it
# was 47 (E2B) and 48 (31B): Triton's JIT compiled again whenever the batch size, the table's width or
# the split count changed its divisibility by 16, or the split count its power of two. Since 2026-12-04
# the glue kernels with a prologue compile once more for T = 1 (the row loaded whole,
# `rms_norm_linear.row_tile`; q_rope's one-token epilogue, `rms_norm_q_rope.launch_config`): 6 q_rope
# compiles per drafter; the attention merge once per tile shape (`q_only_attention.merge_config`).
STEP_COMPILES_PER_KERNEL = 6
STEP_COMPILES = 22


def test_a_decode_compiles_each_kernel_a_few_times_whatever_its_batch_and_context():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python_api"), env.get("PYTHONPATH", "")])
    counts = json.loads(subprocess.run([sys.executable, "-m", "gemma4_mtp_kernels.triton.aot", "--step-compiles"],
                                       env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert set(counts) == {"E2B", "E4B", "26B-A4B", "31B"}
    for name, per_kernel in counts.items():
        print(name, sum(per_kernel.values()), per_kernel)
        assert {"_attn_kernel", "_merge_kernel", "_q_rope_kernel"} <= set(per_kernel), name
        assert max(per_kernel.values()) <= STEP_COMPILES_PER_KERNEL, (name, per_kernel)
        assert sum(per_kernel.values()) <= STEP_COMPILES, (name, per_kernel)
