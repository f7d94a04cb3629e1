"""The real Gemma 4 drafter shapes (SPEC §1), for tests, benchmarks and engines sizing buffers.

Hb = target hidden, Hd = drafter hidden, inter = MLP width, Hq = query heads, Hkv_* = KV heads and
D_* = head dims of the target's sliding / full layers that the drafter reads, window = sliding window,
centroids / top_k = the two-stage centroid head (None: dense LM head).
"""

DRAFTERS = {
    "E2B": dict(Hb=1536, Hd=256, inter=2048, Hq=4, Hkv_swa=1, Hkv_full=1, D_swa=256, D_full=512, window=512,
                centroids=2048, top_k=32, vocab=262144),
    "E4B": dict(Hb=2560, Hd=256, inter=2048, Hq=4, Hkv_swa=2, Hkv_full=2, D_swa=256, D_full=512, window=512,
                centroids=2048, top_k=32, vocab=262144),
    "26B-A4B": dict(Hb=2816, Hd=1024, inter=8192, Hq=16, Hkv_swa=8, Hkv_full=2, D_swa=256, D_full=512, window=1024,
                    centroids=None, top_k=None, vocab=262144),
    "31B": dict(Hb=5376, Hd=1024, inter=8192, Hq=32, Hkv_swa=16, Hkv_full=4, D_swa=256, D_full=512, window=1024,
                centroids=None, top_k=None, vocab=262144),
}
