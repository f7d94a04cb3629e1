"""vLLM's Triton unified attention as the attention benchmark's anchor, without installing vLLM.

The GPU image has no vLLM and cannot install one. vLLM's kernel file
(`vllm/v1/attention/ops/triton_unified_attention.py`) runs on its own once its few vLLM imports are
replaced by small stubs (logger, platform queries, env defaults, the KV-quant enum) and its Triton
helper module is inlined. This module writes such a copy from a vLLM wheel or source tree, into a
directory outside this repository or under a git-ignored one such as build/ (vLLM's code is not ours
to commit; an ignored directory can be carried to a GPU machine), and loads it for
`bench_q_only_attention`:

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm              # on a machine with network
    python -m benchmarks.vllm_anchor --make-copy /tmp/anchor --wheel /tmp/vllm/vllm-0.33.0-*.whl
    GEMMA4_MTP_VLLM_UNIFIED_ATTENTION=/tmp/anchor/triton_unified_attention.py python -m benchmarks.run_all

`--download [VERSION]` runs the pip download itself; `--source-dir` takes an installed or unpacked
tree (the directory holding `vllm/`). The copy records the vLLM version and the sha256 of the files
it came from; `load()` adds the copy's own path and sha256, and the benchmark writes all of it into
the results next to how it called the kernel (see `bench_q_only_attention.vllm_call`).
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ENV = "GEMMA4_MTP_VLLM_UNIFIED_ATTENTION"
KERNEL = "vllm/v1/attention/ops/triton_unified_attention.py"
HELPERS = "vllm/v1/attention/ops/triton_attention_helpers.py"
KV_INTERFACE = "vllm/v1/kv_cache_interface.py"
COPY_NAME = "triton_unified_attention.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the stubs provide. A vLLM version whose kernel file needs more fails at --make-copy, naming it.
ENV_DEFAULTS = {"VLLM_BATCH_INVARIANT": False}  # vllm/envs.py defaults
PLATFORM_ATTRS = {"fp8_dtype", "is_device_capability_family", "is_device_capability", "is_cuda", "is_rocm"}

STUBS = '''\
# --- gemma4-mtp-kernels stubs for the vLLM imports of this file (benchmarks/vllm_anchor.py) ---
import enum as _g4_enum
import logging as _g4_logging

import triton
import triton.language as tl


class envs:  # vllm.envs, at its defaults
{envs}


def init_logger(name):  # vllm.logger: a plain logger with the *_once methods vLLM adds
    log = _g4_logging.getLogger(name)
    for level in ("debug", "info", "warning"):
        setattr(log, level + "_once", getattr(log, level))
    return log


class current_platform:  # vllm.platforms on CUDA, answered by torch
    @staticmethod
    def fp8_dtype():
        return torch.float8_e4m3fn

    @staticmethod
    def is_cuda():
        return torch.version.cuda is not None

    @staticmethod
    def is_rocm():
        return torch.version.hip is not None

    @staticmethod
    def _capability(device_id):
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor

    @classmethod
    def is_device_capability(cls, capability, device_id=0):
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return cls._capability(device_id) == capability

    @classmethod
    def is_device_capability_family(cls, capability, device_id=0):
        cap = cls._capability(device_id)
        return cap is not None and cap // 10 == capability // 10


KVQuantMode = _g4_enum.IntEnum("KVQuantMode", {kv_modes!r})  # vllm.v1.kv_cache_interface, values only
# --- end of stubs ---
'''


class Source:
    """A vLLM wheel (zip) or a directory holding `vllm/`: read files by their path in the package."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.zip = zipfile.ZipFile(self.path) if os.path.isfile(self.path) else None
        if self.zip is None and not os.path.isdir(os.path.join(self.path, "vllm")):
            raise SystemExit(f"vllm_anchor: {path} is neither a vLLM wheel nor a directory holding vllm/")

    def read(self, rel: str) -> str:
        try:
            if self.zip is not None:
                return self.zip.read(rel).decode()
            with open(os.path.join(self.path, rel)) as f:
                return f.read()
        except (KeyError, OSError):
            raise SystemExit(f"vllm_anchor: {self.path} has no {rel}") from None

    def version(self) -> str | None:
        for rel in ("vllm/_version.py", "vllm/version.py"):
            try:
                text = self.read(rel)
            except SystemExit:
                continue
            m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
            if m:
                return m.group(1)
        m = re.match(r"vllm-([0-9][^-]*)-", os.path.basename(self.path))
        return m.group(1) if m else None


def sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _top_level_vllm_imports(tree: ast.Module) -> list[ast.stmt]:
    return [n for n in tree.body
            if (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm")
            or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in n.names))]


def _kv_modes(source: str) -> dict[str, int]:
    """KVQuantMode's members (name -> int) from vllm/v1/kv_cache_interface.py."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "KVQuantMode":
            return {t.id: s.value.value for s in node.body if isinstance(s, ast.Assign)
                    for t in s.targets if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, int)}
    raise SystemExit(f"vllm_anchor: no class KVQuantMode in {KV_INTERFACE}")


def _helpers_body(source: str) -> str:
    """The helper module's code without its docstring and imports (it imports only triton)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    drop = set()
    for n in tree.body:
        is_doc = isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        if isinstance(n, (ast.Import, ast.ImportFrom)) or (is_doc and n is tree.body[0]):
            if isinstance(n, ast.ImportFrom) and n.module not in ("__future__", "vllm.triton_utils"):
                raise SystemExit(f"vllm_anchor: {HELPERS} imports {n.module}, which the stubs do not cover")
            drop.update(range(n.lineno - 1, n.end_lineno))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _check_stub_coverage(kernel: str) -> None:
    tree = ast.parse(kernel)
    used = {(n.value.id, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("envs", "current_platform")}
    missing = sorted(f"{obj}.{attr}" for obj, attr in used
                     if (obj == "envs" and attr not in ENV_DEFAULTS) or (obj == "current_platform" and attr not in PLATFORM_ATTRS))
    if missing:
        raise SystemExit(f"vllm_anchor: {KERNEL} uses {', '.join(missing)}, which the stubs do not provide; "
                         "extend ENV_DEFAULTS / PLATFORM_ATTRS in benchmarks/vllm_anchor.py")


def stubbed_copy(src: Source) -> str:
    """The kernel file's text with its top-level vLLM imports replaced: helpers inlined, the rest stubbed."""
    kernel, helpers, kv = src.read(KERNEL), src.read(HELPERS), src.read(KV_INTERFACE)
    _check_stub_coverage(kernel)
    tree = ast.parse(kernel)
    imports = _top_level_vllm_imports(tree)
    known = {"vllm.envs", "vllm.logger", "vllm.platforms", "vllm.triton_utils",
             "vllm.v1.attention.ops.triton_attention_helpers", "vllm.v1.kv_cache_interface"}
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in imports]
    unknown = [m for m in names if m not in known]
    if unknown:
        raise SystemExit(f"vllm_anchor: {KERNEL} imports {unknown}, which the stubs do not cover")
    version = src.version()
    meta = {"vllm_version": version, "source": os.path.basename(src.path), "files": {
        KERNEL: sha256(kernel), HELPERS: sha256(helpers), KV_INTERFACE: sha256(kv)},
        "stubbed_imports": names, "inlined": HELPERS}
    envs = "\n".join(f"    {k} = {v!r}" for k, v in ENV_DEFAULTS.items())
    header = (f"# Stubbed copy of vLLM {version}'s {KERNEL} (Apache-2.0, Copyright contributors to the vLLM\n"
              f"# project), written by gemma4-mtp-kernels' benchmarks/vllm_anchor.py for benchmarking only.\n"
              f"GEMMA4_MTP_ANCHOR = {meta!r}\n")
    block = header + STUBS.format(envs=envs, kv_modes=_kv_modes(kv)) + \
        f"\n# --- inlined {HELPERS} ---\n" + _helpers_body(helpers) + "# --- end of inlined helpers ---\n"
    lines = kernel.splitlines(keepends=True)
    first = imports[0].lineno - 1
    drop = {i for n in imports for i in range(n.lineno - 1, n.end_lineno)}
    out = [block if i == first else line for i, line in enumerate(lines) if i == first or i not in drop]
    return "".join(out)


def repo_problem(path: str) -> str | None:
    """Why `path` may not hold vLLM's code, or None: a path in this repository's work tree is allowed
    only where git ignores it (e.g. build/, which a GPU session can carry), so the copy can never be
    committed."""
    path = os.path.abspath(path)
    if os.path.commonpath([path, ROOT]) != ROOT:
        return None
    try:
        ignored = subprocess.run(["git", "check-ignore", "-q", os.path.relpath(path, ROOT)], cwd=ROOT,
                                 capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ignored = False
    if ignored:
        return None
    return (f"{path} is inside this repository and not ignored by git; vLLM's code must never be committed: "
            "keep the copy outside the repository or under an ignored directory such as build/")


def make_copy(out_dir: str, src: Source) -> str:
    out_dir = os.path.abspath(out_dir)
    problem = repo_problem(out_dir)
    if problem:
        raise SystemExit(f"vllm_anchor: {problem}")
    text = stubbed_copy(src)
    ast.parse(text)  # the copy must at least be valid Python
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, COPY_NAME)
    with open(path, "w") as f:
        f.write(text)
    return path


def _download(version: str | None, into: str) -> str:
    spec = f"vllm=={version}" if version else "vllm"
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", into], check=True)
    wheels = sorted(glob.glob(os.path.join(into, "vllm-*.whl")))
    if not wheels:
        raise SystemExit(f"vllm_anchor: pip download {spec} left no wheel in {into}")
    return wheels[-1]


_LOADED: dict[str, object] = {}


def load(path: str | None = None):
    """(module, provenance) of vLLM's unified attention: the stubbed copy named by
    $GEMMA4_MTP_VLLM_UNIFIED_ATTENTION (or `path`), else an installed vLLM's. Raises LookupError with
    the reason when there is neither; a copy in a committable place of this repository is refused
    (vLLM's code is never taken from the repository)."""
    path = path or os.environ.get(ENV)
    if not path:
        return _installed()
    path = os.path.abspath(path)
    problem = repo_problem(path)
    if problem:
        raise LookupError(f"{ENV}: {problem}")
    if not os.path.isfile(path):
        raise LookupError(f"{ENV}={path} is not a file")
    with open(path, "rb") as f:
        digest = sha256(f.read())
    key = f"{path}:{digest}"
    if key not in _LOADED:
        spec = importlib.util.spec_from_file_location(f"gemma4_mtp_vllm_anchor_{digest[:12]}", path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - any failure is the reason the anchor is missing
            raise LookupError(f"{path} failed to load ({type(e).__name__}: {str(e)[:200]})") from None
        if not callable(getattr(mod, "unified_attention", None)):
            raise LookupError(f"{path} defines no unified_attention")
        _LOADED[key] = mod
    mod = _LOADED[key]
    meta = dict(getattr(mod, "GEMMA4_MTP_ANCHOR", None) or {})
    return mod, {"how_obtained": f"stubbed copy of vLLM's {KERNEL} loaded from ${ENV}", "path": path,
                 "sha256": digest, "vllm_version": meta.get("vllm_version"), "copied_from": meta.get("source"),
                 "original_sha256": meta.get("files")}


def _installed():
    name = KERNEL[:-3].replace("/", ".")
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        raise LookupError(f"no vLLM kernel: {ENV} is not set (python -m benchmarks.vllm_anchor --make-copy DIR "
                          f"writes a copy) and {name} is not importable ({type(e).__name__}: {str(e)[:120]})") from None
    with open(mod.__file__, "rb") as f:
        digest = sha256(f.read())
    import vllm
    return mod, {"how_obtained": f"installed vLLM, {name}", "path": mod.__file__, "sha256": digest,
                 "vllm_version": getattr(vllm, "__version__", None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-copy", metavar="DIR", required=True,
                   help=f"write DIR/{COPY_NAME} (outside this repository, or under an ignored directory such as build/)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--wheel", help="a downloaded vLLM wheel")
    g.add_argument("--source-dir", help="a directory holding vllm/ (site-packages or a source checkout)")
    g.add_argument("--download", nargs="?", const="", metavar="VERSION",
                   help="pip download vllm[==VERSION] --no-deps into a temporary directory first")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = args.wheel or args.source_dir or _download(args.download or None, tmp)
        path = make_copy(args.make_copy, Source(where))
    _, prov = load(path)
    print(f"wrote {path} (vLLM {prov['vllm_version']}, sha256 {prov['sha256'][:16]}...)")
    print(f"export {ENV}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
