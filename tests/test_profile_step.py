"""benchmarks.profile_step's bookkeeping (the GPU part runs in gpu_check.sh): replays cut apart, each
kernel's median duration and gap, a step's span split into kernel time and gaps."""
import pytest

from benchmarks import profile_step


def test_kernel_names_lose_templates_and_parameters():
    assert profile_step.short_name("void gemma4_mtp::attention::kernel<__nv_bfloat16, 256, (bool)1>"
                                   "(gemma4_mtp::AttentionParams, int)") == "gemma4_mtp::attention::kernel"
    assert profile_step.short_name("_q_rope_kernel") == "_q_rope_kernel"


def test_medians_gaps_and_overlap():
    # two kernels a replay; the second overlaps the first by 1 µs in replay 0 (PDL), starts 2 µs after in 1 and 2
    replays = [[("a", 0.0, 5.0), ("b", 4.0, 3.0)],
               [("a", 100.0, 6.0), ("b", 108.0, 3.0)],
               [("a", 200.0, 7.0), ("b", 209.0, 5.0)]]
    r = profile_step.analyse(replays)
    assert [k["name"] for k in r["kernels"]] == ["a", "b"]
    assert r["kernels"][0] == {"name": "a", "us": 6.0, "gap_us": 0.0}
    assert r["kernels"][1] == {"name": "b", "us": 3.0, "gap_us": 2.0}
    # spans 7, 11, 14; kernel time 8, 9, 12; gaps -1, 2, 2
    assert (r["span_us"], r["kernel_us"], r["gap_us"], r["n_kernels"]) == (11.0, 9.0, 2.0, 2)


def test_replays_must_launch_the_same_kernels():
    events = [("a", 0.0, 1.0), ("b", 2.0, 1.0), ("a", 10.0, 1.0), ("c", 12.0, 1.0)]
    with pytest.raises(ValueError, match="replay 1 launched other kernels"):
        profile_step.analyse(profile_step.split_replays(events, 2))
    with pytest.raises(ValueError, match="3 kernels recorded for 2 replays"):
        profile_step.split_replays(events[:3], 2)
    # out of order in, start order out
    cut = profile_step.split_replays(list(reversed(events)), 2)
    assert [k[0] for k in cut[0]] == ["a", "b"] and [k[0] for k in cut[1]] == ["a", "c"]


def test_without_a_gpu_it_says_so(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert profile_step.main(["--out", str(tmp_path / "p.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
