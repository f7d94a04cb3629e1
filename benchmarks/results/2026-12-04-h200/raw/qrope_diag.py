# GPU diagnostic of test_real_shapes_on_gpu[1-26B]: where do 9% of q_rope's elements differ from the CPU reference?
import sys, os, torch
sys.path.insert(0, "tests")
import cases_fused_glue as c
stats = []
def am(got, exact, ref, dtype, what, **kw):
    g, e, r = got.double().cpu(), exact.double().cpu(), ref.double().cpu()
    scale = e.abs().max().item()
    ulp = torch.finfo(dtype).eps
    d = (g - r).abs() / (r.abs().clamp_min(1e-30) * ulp)  # relative ulps
    print(f"{what}: got!=ref {(g != r).double().mean().item():.4f}  ref!=exact {(r != e).double().mean().item():.4f}  "
          f"got!=exact {(g != e).double().mean().item():.4f}  max|got-exact|/scale {((g - e).abs().max() / scale).item():.2e}  "
          f"max rel ulps got-ref {d.max().item():.1f}  >1.5ulp {(d > 1.5).double().mean().item():.4f}", flush=True)
c.assert_matches = am
G = torch.Generator
def q(backend, T, H, Hq, D, kind, prop=False):
    return c.check_glue("rms_norm_q_rope", backend, "cuda", T, H, Hq * D, torch.bfloat16, kind, gen=G().manual_seed(T + H + D), D=D, proportional=prop)
def lin(backend, T, H, N, kind):
    return c.check_glue("rms_norm_linear", backend, "cuda", T, H, N, torch.bfloat16, kind, gen=G().manual_seed(T + H + N))
backends = sys.argv[1].split(",")
import gemma4_mtp_kernels.triton.rms_norm_q_rope; m = sys.modules["gemma4_mtp_kernels.triton.rms_norm_q_rope"]
for be in backends:
    for kind in ("layer", "none"):
        q(be, 1, 1024, 16, 256, kind)
    q(be, 64, 1024, 16, 256, "layer")
    q(be, 1, 1024, 8, 256, "layer")   # N 2048
    q(be, 1, 1024, 16, 512, "layer", True)
    lin(be, 1, 1024, 4096, "layer")
    lin(be, 1, 1024, 4096, "none")
if "triton" in backends:
    orig = m.launch_config
    m.launch_config = lambda T, N, D: {**orig(T, N, D), "BLOCK_N": 32}
    print("BLOCK_N forced to 32:"); q("triton", 1, 1024, 16, 256, "layer")
    m.launch_config = lambda T, N, D: {**orig(T, N, D), "BLOCK_N": 64}
    print("BLOCK_N forced to 64:"); q("triton", 1, 1024, 8, 256, "layer")
    m.launch_config = lambda T, N, D: {**orig(T, N, D), "num_stages": 1}
    print("num_stages 1:"); q("triton", 1, 1024, 16, 256, "layer")
    m.launch_config = orig
