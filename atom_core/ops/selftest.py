"""``python -m atom_core.ops.selftest``: check every op of every available backend against the twins on
this machine, and record which passed (``atom_core.ops.verified``), so that ``auto`` chooses AITER
only where it has been verified here.

    python -m atom_core.ops.selftest                  # full grid, every available backend, writes the record
    python -m atom_core.ops.selftest --grid quick     # one or two small shapes per op (minutes under the interpreter)
    python -m atom_core.ops.selftest --backends aiter --ops paged_attention sample
    python -m atom_core.ops.selftest --show           # print this machine's entry of the record

Each case (``atom_core.ops.selftest_cases``) runs the public op with ``backend=<name>`` (strict) and
with ``backend="torch"`` on the same seeded inputs, with the debug checks on, and compares the
outputs under ``atom_core.ops.tolerances``. A case the backend refuses (``BackendUnavailable``: a
shape or dtype it does not serve) counts as refused, not failed: ``auto`` never sends it such a call.
A backend passes an op when it served at least one case and every case it served matched; an op
whose every case it refused gets ``passed: null`` (no verdict). Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from atom_core.ops import dispatch, verified
from atom_core.ops.dispatch import BackendUnavailable
from atom_core.ops.selftest_cases import Case, all_cases
from atom_core.ops.validation import debug_checks

MAX_FAILURES_KEPT = 5  # per op and backend, in the record


def _run_case(case: Case, backend: str) -> tuple[str, str | None]:
    """("passed" | "failed" | "refused", detail)."""
    try:
        with debug_checks():
            want = case.run("torch")
            got = case.run(backend)
    except BackendUnavailable as refusal:
        return "refused", str(refusal)
    except Exception as error:  # noqa: BLE001 - a crashing kernel is a failure to record, not to raise
        return "failed", f"{case.label}: raised {type(error).__name__}: {error}"
    why = case.check(got, want)
    return ("passed", None) if why is None else ("failed", f"{case.label}: {why}")


def run_selftest(*, grid: str = "full", backends: list[str] | None = None, ops: list[str] | None = None,
                 device: torch.device | str | None = None, log=None) -> dict[str, dict[str, dict]]:
    """Results ``{op: {backend: {"passed", "cases", "refused", "failures"}}}`` (the record's format).

    backends: default every backend available here; ops: default every op of the grid; device: default the
    current CUDA device, else the CPU. ``log`` (e.g. ``print``) gets one line per op and backend.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = dispatch.available_backends() if backends is None else backends
    cases = all_cases(grid, device)  # every op of atom_core.ops (tests/ops/test_selftest.py checks)
    results: dict[str, dict[str, dict]] = {}
    for op_name in sorted(cases if ops is None else ops):
        for backend in backends:
            if backend not in dispatch.OPS[op_name].backends:
                continue
            start = time.perf_counter()
            outcomes = [_run_case(case, backend) for case in cases[op_name]]
            served = [detail for status, detail in outcomes if status != "refused"]
            failures = [detail for status, detail in outcomes if status == "failed"]
            result = {"passed": None if not served else not failures, "cases": len(served),
                      "refused": len(outcomes) - len(served), "failures": failures[:MAX_FAILURES_KEPT]}
            results.setdefault(op_name, {})[backend] = result
            if log is not None:
                status = {True: "passed", False: "FAILED", None: "no verdict"}[result["passed"]]
                log(f"{op_name:24s} {backend:7s} {status:10s} {result['cases']:3d} served {result['refused']:3d} "
                    f"refused  {time.perf_counter() - start:6.1f} s" + "".join(f"\n    {f}" for f in failures))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atom_core.ops.selftest",
        description="Check every op of every available backend against the reference twins on this machine and "
                    "record which passed; auto chooses AITER only where the record says so.")
    parser.add_argument("--grid", choices=("quick", "full"), default="full")
    parser.add_argument("--backends", nargs="+", choices=dispatch.BACKENDS, metavar="BACKEND",
                        help=f"some of {', '.join(dispatch.BACKENDS)} (default: every available one)")
    op_names = sorted(all_cases("quick", "cpu"))
    parser.add_argument("--ops", nargs="+", choices=op_names, metavar="OP",
                        help=f"some of {', '.join(op_names)} (default: every op)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--no-write", action="store_true", help="do not write the record")
    parser.add_argument("--show", action="store_true", help="print this machine's entry of the record and exit")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.show:
        key = verified.record_key(device)
        entry = verified.read_record()["entries"].get(verified.key_string(key))
        print(f"record {verified.record_path()}, key {key}:")
        print(json.dumps(entry, indent=1, sort_keys=True) if entry else "no entry for this device and these versions")
        return 0
    unavailable = [b for b in args.backends or [] if not dispatch.backend_available(b)]
    if unavailable:
        parser.error(f"not available on this machine: {unavailable}")
    print(f"selftest on {verified.device_name(device)} ({device}), {verified.library_versions()}, grid {args.grid}")
    results = run_selftest(grid=args.grid, backends=args.backends, ops=args.ops, device=device, log=print)
    if not args.no_write:
        print(f"record written to {verified.write_results(device, results)}")
    failed = any(r["passed"] is False for by_backend in results.values() for r in by_backend.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
