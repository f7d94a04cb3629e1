"""benchmarks.profile_decode on CPU (gpu_check.sh runs it on the GPU): the phase timers wrap the decode
loop's own functions without changing what it decodes, every round's host time is split among the
phases, and a configuration that drafts nothing spends nothing in the draft phase."""
import json

import pytest
import torch

from benchmarks import profile_decode

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


def test_phases_split_the_rounds_and_change_nothing(tmp_path):
    out = tmp_path / "decode.json"
    names = ["target_only", "chain_sampled_drafts"]
    assert profile_decode.main(["--out", str(out), "--device", "cpu", "--max-new-tokens", "8",
                                "--configs", ",".join(names)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert [r["config"] for r in rows] == names
    from gemma4_mtp import load_drafter, load_target, speculative_generate
    from gemma4_mtp.__main__ import ASSETS, DEFAULT_PROMPT
    from tokenizers import Tokenizer
    target, drafter = load_target(ASSETS / "target"), load_drafter(ASSETS / "drafter")
    prompt = torch.tensor(Tokenizer.from_file(str(ASSETS / "tokenizer.json")).encode(DEFAULT_PROMPT).ids)
    for r in rows:
        host = r["host_ms_per_round"]
        assert set(host) == {*profile_decode.PHASES, "other"}
        assert all(v >= 0 for v in host.values()), host
        assert sum(host.values()) == pytest.approx(r["ms_per_round"], rel=1e-3, abs=1e-3)
        assert host["forward"] > 0 and host["verify"] > 0 and host["read"] > 0
        assert len(r["round_ms"]) == r["rounds"] and all(t > 0 for t in r["round_ms"])
        assert sum(r["round_ms"]) <= r["wall_ms"] and r["new_static_shapes_timed"] == 0  # no graphs on CPU
        assert r["gpu_kernel_ms_per_round"] is None  # CPU
        kw = dict(profile_decode.CONFIGS[r["config"]], max_new_tokens=8, seed=0)
        plain = speculative_generate(target, drafter if kw["num_draft_tokens"] else None, prompt, **kw)
        assert (r["rounds"], r["tokens_per_forward"]) == (plain.stats.rounds,
                                                          round(plain.stats.tokens_per_target_forward, 3))
    assert 10 * rows[0]["host_ms_per_round"]["draft"] < rows[1]["host_ms_per_round"]["draft"]


def test_unknown_configuration_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        profile_decode.main(["--out", str(tmp_path / "x.json"), "--configs", "chain_greedy,fast"])
