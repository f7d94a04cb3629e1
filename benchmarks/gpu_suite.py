"""The GPU suite's verdict per (op, backend), from pytest's junit XML of a per-file run.

gpu_check.sh runs each GPU test file on its own (a crash then costs one file, not the suite), leaving
in one directory, per file `tests/<stem>.py`: `<stem>.rc` (pytest's exit status, written whatever
happened) and `<stem>.xml` (--junitxml; absent when pytest died). This module turns that directory
into `gpu_suite.json`, which `benchmarks.make_verified` reads next to the run's results.json:

    python -m benchmarks.gpu_suite DIR --out gpu_suite.json

    {"schema": 1, "complete": bool,           # no file crashed or timed out
     "files": {stem: {rc, status: passed|failed|no tests|timed out|crashed, tests, failures, errors, skipped,
                      seconds: pytest's time for the file (None without its XML)}},
     "ops": {op: {backend: {passed, tests, failures, errors, skipped, files: [stem...], why}}}}

A file `test_<op module>_<backend>.py` (e.g. test_q_only_attention_cuda.py) counts for that op and
backend, `test_<group>_<backend>.py` (GROUPS, e.g. test_fused_glue_cuda.py) for the ops of the group.
A file for one backend and several ops (a group's, or e.g. test_cuda_review.py for all) counts each
test for the op its name mentions, and for every op it covers when it mentions none; a file that died
counts against every op it covers (a file with no GPU test, exit 5, counts for nothing). (op, backend) passed only if at least one of its tests ran (not skipped),
none failed or errored, and every file covering it ran to its end.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pkgutil
import re
import xml.etree.ElementTree as ET

from .make_verified import RESULTS, load_runs

BACKENDS = ("cuda", "triton")
# test files named after a group of ops: test_<group>_<backend>.py covers exactly these
GROUPS = {"fused_glue": ("rms_norm_linear", "rms_norm_gate_up", "rms_norm_q_rope")}


def op_modules() -> dict[str, str]:
    """Public op module name -> op name (gemma4_mtp_kernels/ops/<module>.py defines OP)."""
    import importlib

    from gemma4_mtp_kernels import ops
    return {m.name: importlib.import_module(f"gemma4_mtp_kernels.ops.{m.name}").OP
            for m in pkgutil.iter_modules(ops.__path__)}


def _keywords(modules: dict[str, str]) -> list[tuple[str, str]]:
    """Words that name an op in a test name, longest first: the op, its module, and the short words
    the cross-op test files use."""
    words = {}
    for mod, op in modules.items():
        words[op] = op
        words[mod] = op
    short = {"attention": "q_only_paged_attention", "centroid": "centroid_logits", "down_proj": "fused_concat_down_proj",
             "concat": "fused_concat_down_proj", "verify": "tree_verify", "tree": "tree_verify"}
    words.update({w: op for w, op in short.items() if op in modules.values()})
    return sorted(words.items(), key=lambda kv: -len(kv[0]))


def file_scope(stem: str, modules: dict[str, str]) -> tuple[str | None, tuple[str, ...] | None]:
    """(backend, the ops a test file covers, or None for every op of the backend); (None, None) if
    neither."""
    name = stem.removeprefix("test_")
    for backend in BACKENDS:
        if name.endswith("_" + backend):
            scope = name[: -len(backend) - 1]
            if scope in modules:
                return backend, (modules[scope],)
            if scope in GROUPS:
                return backend, tuple(op for op in GROUPS[scope] if op in modules.values())
    tokens = name.split("_")
    backend = next((b for b in BACKENDS if b in tokens), None)
    return backend, None


def _read_xml(xml_path: str) -> tuple[list[tuple[str, str]], float | None]:
    """(name, outcome: passed | failed | error | skipped) per testcase, and pytest's own time for the file
    (its testsuite elements' `time`, None without one)."""
    root = ET.parse(xml_path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        tags = {child.tag for child in tc}
        outcome = "failed" if "failure" in tags else "error" if "error" in tags else "skipped" if "skipped" in tags else "passed"
        cases.append((tc.get("name", ""), outcome))
    times = [float(t) for t in (ts.get("time") for ts in root.iter("testsuite")) if t]
    return cases, round(sum(times), 2) if times else None


def _status(rc: int | None, has_xml: bool) -> str:
    if rc in (124, 137):
        return "timed out"
    if rc == 5:
        return "no tests"
    if rc in (0, 1) and has_xml:
        return "passed" if rc == 0 else "failed"
    return "crashed"


def convert(directory: str, modules: dict[str, str] | None = None) -> dict:
    modules = modules if modules is not None else op_modules()
    words = _keywords(modules)
    ops: dict[str, dict[str, dict]] = {}
    files = {}

    def slot(op, backend):
        return ops.setdefault(op, {}).setdefault(backend, {"tests": 0, "failures": 0, "errors": 0, "skipped": 0,
                                                           "files": [], "unfinished": []})

    stems = sorted({os.path.splitext(os.path.basename(p))[0]
                    for p in glob.glob(os.path.join(directory, "*.rc")) + glob.glob(os.path.join(directory, "*.xml"))})
    for stem in stems:
        rc_path, xml_path = os.path.join(directory, stem + ".rc"), os.path.join(directory, stem + ".xml")
        try:
            with open(rc_path) as f:
                rc = int(f.read().strip())
        except (OSError, ValueError):
            rc = None
        cases, seconds = [], None
        if os.path.exists(xml_path):
            try:
                cases, seconds = _read_xml(xml_path)
            except ET.ParseError:
                xml_path = None
        has_xml = bool(xml_path) and os.path.exists(xml_path)
        status = _status(rc, has_xml)
        counts = {k: sum(1 for _, o in cases if o == v) for k, v in
                  (("failures", "failed"), ("errors", "error"), ("skipped", "skipped"))}
        files[stem] = {"rc": rc, "status": status, "tests": len(cases), **counts, "seconds": seconds}
        backend, file_ops = file_scope(stem, modules)
        if backend is None:
            continue
        covered = list(file_ops) if file_ops else sorted(set(modules.values()))
        for op in covered:
            s = slot(op, backend)
            s["files"].append(stem)
            if status in ("crashed", "timed out"):
                s["unfinished"].append(f"{stem}: {status}" + (f" (exit {rc})" if rc is not None else " (no exit status)"))
        for name, outcome in cases:
            hit = next((op for w, op in words if w in name and op in covered), None)
            targets = covered if len(covered) == 1 or hit is None else [hit]
            for op in targets:
                s = slot(op, backend)
                s["tests"] += 1
                s["failures"] += outcome == "failed"
                s["errors"] += outcome == "error"
                s["skipped"] += outcome == "skipped"
    for per_backend in ops.values():
        for s in per_backend.values():
            ran = s["tests"] - s["skipped"]
            why = []
            if s["unfinished"]:
                why.append("; ".join(s["unfinished"]))
            if s["failures"] or s["errors"]:
                why.append(f"{s['failures']} failed, {s['errors']} errors")
            if ran == 0:
                why.append("no test ran")
            s["passed"] = not why
            s["why"] = "; ".join(why) if why else f"{ran} tests passed"
            del s["unfinished"]
    complete = bool(files) and all(f["status"] not in ("crashed", "timed out") for f in files.values())
    return {"schema": 1, "complete": complete, "files": files, "ops": ops}


# A line of gpu_check.sh's gpu_suite.txt (runs from before gpu_suite.json held the files' times): the file,
# then pytest's last line, which ends with its time ("... 25 passed in 63.94s (0:01:03)")
_SUITE_LINE = re.compile(r"^(test_\w+) .* in ([0-9.]+)s\b")


def file_seconds(results_dir: str) -> dict[str, float]:
    """Each test file's pytest time in the newest committed run under `results_dir` (make_verified's runs)
    that recorded any: its gpu_suite.json, or the gpu_suite.txt that gpu_check.sh wrote beside it (or
    under raw/)."""
    for run in sorted(load_runs(results_dir), key=lambda r: r.date, reverse=True):
        files = (run.suite or {}).get("files", {})
        seconds = {stem: f["seconds"] for stem, f in files.items() if f.get("seconds") is not None}
        for txt in (os.path.join(results_dir, run.name, "gpu_suite.txt"),
                    os.path.join(results_dir, run.name, "raw", "gpu_suite.txt")):
            if seconds or not os.path.exists(txt):
                continue
            with open(txt) as f:
                seconds = {m[1]: float(m[2]) for m in map(_SUITE_LINE.match, f) if m}
        if seconds:
            return seconds
    return {}


def order(paths: list[str], results_dir: str) -> list[str]:
    """The test files in the order gpu_check.sh starts them: those without a time in the newest run first
    (new files, which may be long), then the longest first, so that the last to start are short and the
    suite ends soon after its longest file (on 2026-12-04 the files took 495 s in all, the longest 64)."""
    seconds = file_seconds(results_dir)
    timed = {p: seconds.get(os.path.splitext(os.path.basename(p))[0]) for p in paths}
    return [p for p in paths if timed[p] is None] + sorted((p for p in paths if timed[p] is not None),
                                                           key=lambda p: -timed[p])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="per-(op, backend) verdict of a per-file GPU test run")
    p.add_argument("paths", nargs="+", help="the directory holding <stem>.rc and <stem>.xml per test file; "
                                            "with --order, test files")
    p.add_argument("--out")
    p.add_argument("--order", action="store_true", help="print the test files in the order to start them")
    p.add_argument("--results", default=RESULTS)
    args = p.parse_args(argv)
    if args.order:
        print(" ".join(order(args.paths, args.results)))
        return 0
    if len(args.paths) != 1 or not args.out:
        p.error("a run's directory and --out, or --order with test files")
    suite = convert(args.paths[0])
    with open(args.out, "w") as f:
        json.dump(suite, f, indent=1)
    for op, per in sorted(suite["ops"].items()):
        for backend, s in sorted(per.items()):
            print(f"{op:24s} {backend:7s} {'PASSED' if s['passed'] else 'not passed'}: {s['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
