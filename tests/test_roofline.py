"""The cost model (benchmarks/roofline.py) against arithmetic done by hand.

The expected numbers below were worked out on paper from SPEC §1 shapes, term by term (shown in
the comments), not produced by the code under test.
"""
import pytest

from benchmarks import devices, roofline


def test_e2b_full_layer_attention_8k_by_hand():
    # B=1, Q=1, Hq=4, Hkv=1, D=512, ctx=8192, block 16
    # K and V:   8192 * 1 * 512 * 2 (K,V) * 2 bytes = 16,777,216
    # q + out:   2 * 1 * 1 * 4 * 512 * 2             =      8,192
    # seq_lens 4 + block table 512 blocks * 4        =      2,052
    c = roofline.attention(1, 1, 4, 1, 512, 8192)
    assert c.bytes == 16_777_216 + 8_192 + 2_052 == 16_787_460
    assert c.flops == 4 * 4 * 8192 * 512 == 67_108_864
    # H200 floor: 16,787,460 / 4.8e12 = 3.4974e-6 s (memory bound: 67 MFLOP / 989 TFLOP/s = 68 ns)
    assert c.floor_s(devices.DATASHEET["H200"]) == pytest.approx(3.49739e-6, rel=1e-5)


def test_sliding_window_reads_only_the_window():
    # 31B sliding: Hkv=16, D=256, window 1024 at any ctx >= 1024:
    # 1024 * 16 * 256 * 2 * 2 = 16,777,216 bytes of K/V; at ctx 300 only 300 entries: 4,915,200
    long = roofline.attention(1, 1, 32, 16, 256, 32768, window=1024)
    short = roofline.attention(1, 1, 32, 16, 256, 300, window=1024)
    assert long.parts["target KV"] == 16_777_216
    assert short.parts["target KV"] == 4_915_200


def test_31b_drafter_step_8k_by_hand():
    # pre_projection   1024 * 2 * 5376 * 2                                   =  22,020,096
    # embedding row    5376 * 2                                              =      10,752
    # q_proj + o_proj  3 sliding * 2*1024*32*256 + 1 full * 2*1024*32*512
    #                  = 50,331,648 + 33,554,432 = 83,886,080 params * 2      = 167,772,160
    # MLP              4 * 3 * 1024 * 8192 = 100,663,296 params * 2           = 201,326,592
    # norms            3 * (4*1024 + 256) + (4*1024 + 512) + 1024 = 18,688 * 2 =      37,376
    # post_projection  5376 * 1024 * 2                                       =  11,010,048
    # full-layer KV    8192 * 4 * 512 * 2 * 2                                =  67,108,864
    # sliding KV       3 layers * 1024 * 16 * 256 * 2 * 2                    =  50,331,648
    # dense LM head    262144 * 1024 * 2                                     = 536,870,912
    # step I/O         hidden in + out 2 * 5376 * 2, token id in 4 + out 8    =      21,516
    # total                                                                  = 1,056,509,964
    c = roofline.drafter_step("31B", 1, 8192)
    assert c.parts["target KV: full layer"] == 67_108_864
    assert c.parts["target KV: sliding layers"] == 50_331_648
    assert c.parts["lm_head (dense)"] == 536_870_912
    assert c.parts["weights: MLP"] == 201_326_592
    assert c.bytes == 1_056_509_964
    # 1,056,509,964 B / 4.8e12 B/s = 220.106 µs on an H200
    assert c.floor_s(devices.DATASHEET["H200"]) == pytest.approx(220.106e-6, rel=1e-5)


def test_e2b_draft_round_8k_by_hand():
    # one E2B step at 8K (B=1, Q=1):
    #   pre 256*3072*2 = 1,572,864; embedding row 1536*2 = 3,072
    #   q+o (3 * 2*256*4*256 + 2*256*4*512) * 2 = 2,621,440 * 2 = 5,242,880
    #   MLP 4 * 3*256*2048 * 2 = 12,582,912; norms (3*1280 + 1536 + 256) * 2 = 11,264
    #   post 1536*256*2 = 786,432; full KV 8192*512*2*2 = 16,777,216; sliding KV 3*512*256*2*2 = 1,572,864
    #   centroids 2048*256*2 = 1,048,576; 4096 gathered rows * 256 * 2 = 2,097,152; their ids 4096*4 = 16,384
    #   step I/O 2*1536*2 + 12 = 6,156                                     step = 41,717,772
    # round (k=4): 4 * 41,717,772 = 166,871,088, plus tree_verify over N=5 nodes:
    #   logits 5 * 262144 * 2 = 2,621,440; tokens+parents in 5*12, outputs 5*12 + 8 = 128   round = 169,492,656
    assert roofline.drafter_step("E2B", 1, 8192).bytes == 41_717_772
    c = roofline.draft_round("E2B", 1, 8192, 4)
    assert c.bytes == 169_492_656
    # 169,492,656 / 4.8e12 = 35.311 µs on H200; / 2.039e12 = 83.125 µs on A100
    assert c.floor_s(devices.DATASHEET["H200"]) == pytest.approx(35.3110e-6, rel=1e-5)
    assert c.floor_s(devices.DATASHEET["A100-80GB"]) == pytest.approx(83.1253e-6, rel=1e-5)


def test_what_dominates_a_round():
    # E2B at 8K: weights 4 * 20.2 MB = 80.8 MB vs KV 4 * 18.35 MB = 73.4 MB -> weights;
    # at 32K the full layer alone is 4 * 67.1 MB -> KV. 31B: the 537 MB dense LM head per step.
    assert roofline.dominant(roofline.draft_round("E2B", 1, 8192, 4))[0] == "weights"
    assert roofline.dominant(roofline.draft_round("E2B", 1, 32768, 4))[0] == "target KV"
    assert roofline.dominant(roofline.draft_round("31B", 1, 32768, 4))[0] == "LM head"


def test_centroid_head_vs_dense_head_e2b():
    # centroid (T=1): 2048*256*2 + 4096*256*2 + 4096*4 + 256*2 + 12 = 3,162,636
    # dense fused argmax: 262144*256*2 + 256*2 + 8 = 134,218,248 (a 42.4x ratio in bytes)
    cen = roofline.centroid_head(256, 262144, 2048, 32, 1)
    dense = roofline.dense_head(256, 262144, 1, materialise_logits=False)
    assert cen.bytes == 3_162_636
    assert dense.bytes == 134_218_248
    # HF writes the [1, 262144] bf16 logits and argmax reads them back: + 2 * 524,288
    assert roofline.dense_head(256, 262144, 1, materialise_logits=True).bytes == 134_218_248 + 1_048_576


def test_tree_verify_and_concat_by_hand():
    # greedy B=8, N=5: logits 8*5*262144*2 = 20,971,520; metadata 8*5*12*2 + 2*8*4 = 1,024
    assert roofline.tree_verify(8, 5, 262144).bytes == 20_971_520 + 1_024
    # E2B pre_projection T=8: 256*3072*2 = 1,572,864 weight; 8*1536*2 = 24,576 embedding rows;
    # hidden 24,576 + out 8*256*2 = 4,096 + ids 32; FLOPs 2*8*256*3072 = 12,582,912
    c = roofline.concat_down_proj(1536, 256, 8)
    assert c.bytes == 1_572_864 + 24_576 + 24_576 + 4_096 + 32
    assert c.flops == 12_582_912


def test_floor_is_the_slower_roof():
    c = roofline.Cost("compute bound", {"x": 1e6}, flops=1e12)
    a100 = devices.DATASHEET["A100-80GB"]
    assert c.floor_s(a100) == pytest.approx(1e12 / 312e12)
    c = roofline.Cost("memory bound", {"x": 2.039e9}, flops=1.0)
    assert c.floor_s(a100) == pytest.approx(1e-3)


def test_round_widths_must_match_steps():
    with pytest.raises(ValueError, match="widths"):
        roofline.draft_round("E2B", 1, 8192, 3, widths=(1, 2))
    # a tree round: step widths 1, 2, 4 -> 3 drafter steps and N = 1 + 7 = 8 verified nodes
    tree = roofline.draft_round("E2B", 1, 8192, 3, widths=(1, 2, 4))
    assert tree.parts["verify: target logits"] == 8 * 262144 * 2


def test_device_matching_and_measured_peaks():
    assert devices.match("NVIDIA H200").key == "H200"
    assert devices.match("NVIDIA H100 80GB HBM3").key == "H100-SXM"
    assert devices.match("NVIDIA A100-SXM4-80GB").key == "A100-80GB"
    assert devices.match("NVIDIA H100 PCIe") is None
    assert devices.match("NVIDIA GeForce RTX 4090") is None
    dev = devices.measured({"env": {"device": "NVIDIA H200"}, "device_peaks": {"copy_bytes_per_s": 4.0e12}})
    assert dev.hbm_bytes_per_s == 4.0e12 and dev.bf16_flops_per_s == 989e12 and dev.source == "measured"
    with pytest.raises(ValueError, match="copy bandwidth"):
        devices.measured({"env": {"device": "NVIDIA H200"}, "device_peaks": {}})


def test_cli_tables(capsys, tmp_path):
    assert roofline.main(["--breakdown"]) == 0
    out = capsys.readouterr().out
    assert "| E2B | 1 | 8192 |" in out and "| 31B | 1 | 32768 |" in out
    assert "target KV: full layer" in out
    results = tmp_path / "r.json"
    results.write_text('{"env": {"device": "NVIDIA H200"}, "device_peaks": {"copy_bytes_per_s": 4.0e12}}')
    assert roofline.main(["--json", "--results", str(results)]) == 0
    import json
    data = json.loads(capsys.readouterr().out)
    # the measured device's floor uses the measured 4.0 TB/s: 169,492,656 / 4.0e12 = 42.373 µs
    assert data["E2B B=1 ctx=8192"]["floor_s"]["H200-measured"] == pytest.approx(42.3732e-6, rel=1e-5)
