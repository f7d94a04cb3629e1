"""What every bench_<op>.py shares: the Case record, missing baselines, our backends as baselines,
torch.compile of a composition, and the sanity check of a baseline's output against the reference.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .roofline import Cost


class Missing(Exception):
    """A baseline that cannot run here; the message says why and lands in the results."""


Factory = Callable[[dict], Callable[[], object]]


@dataclass
class Case:
    op: str
    label: str
    params: dict
    cost: Cost
    make_inputs: Callable[[torch.device, torch.dtype, int], dict]  # (device, dtype, seed) -> inputs
    reference: Callable[[dict], object]
    baselines: dict[str, Factory]
    compare: dict[str, Callable[[object, object], dict]] = field(default_factory=dict)  # per baseline
    default_compare: Callable[[object, object], dict] | None = None
    eager: frozenset[str] = frozenset()  # baselines that sync with the host: timed without a CUDA graph


def ours(op: str, backend: str, call: Callable[[Callable, dict, str], object]) -> Factory:
    """A baseline that runs our public op with backend=...; `call(fn, inputs, backend)` binds args.
    A backend that cannot serve the call raises BackendUnavailableError, which the harness reports
    as missing with the library's own reason."""
    def factory(inp):
        import gemma4_mtp_kernels as g

        fn = getattr(g, op)
        return lambda: call(fn, inp, backend)
    return factory


def compiled(fn: Callable, dry: bool) -> Callable:
    """torch.compile of a composition. In a dry run only dynamo's tracing runs (backend='eager'), so
    the code path is exercised without inductor's minutes of C++ compilation on a CPU. On a GPU the
    default automatic-dynamic shapes keep recompiles to about two per op across the case grid."""
    if dry:
        return torch.compile(fn, backend="eager", dynamic=False)
    return torch.compile(fn)


def external(module: str, attr: str | None = None):
    """An external library's module (or attribute), or Missing with the import error."""
    try:
        m = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        raise Missing(f"{module} is not importable ({type(e).__name__}: {str(e)[:160]})") from None
    if attr is None:
        return m
    if not hasattr(m, attr):
        raise Missing(f"{module} has no {attr} (version {getattr(m, '__version__', '?')})")
    return getattr(m, attr)


def needs_cuda(inp: dict, what: str) -> None:
    dev = next(v for v in inp.values() if isinstance(v, torch.Tensor)).device
    if dev.type != "cuda":
        raise Missing(f"{what} runs on CUDA tensors only")


def close(out, ref, *, rtol: float = 2e-2, atol: float = 2e-2) -> dict:
    """A sanity check that a baseline computes the op (not a correctness test: tests/ do that)."""
    out = out[0] if isinstance(out, tuple) else out
    ref = ref[0] if isinstance(ref, tuple) else ref
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "detail": f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    err = (out.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs().max().item()
    worst = err.max().item() if err.numel() else 0.0
    return {"ok": bool(worst <= bound) and not bool(torch.isnan(out).any()), "max_abs_err": worst}


def equal(out, ref) -> dict:
    """Discrete outputs (token ids, accepted paths) must match the reference exactly."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    mism = sum(int((o.cpu().long() != r.cpu().long()).sum()) for o, r in zip(outs, refs))
    return {"ok": mism == 0, "mismatches": mism}
