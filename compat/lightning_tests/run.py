"""Run a selection of Lightning's own test suite with single-process CPU Trainers forced onto a strategy.

    python compat/lightning_tests/run.py --strategy ddp    [--tests /tmp/lightning-tests/tests]
    python compat/lightning_tests/run.py --strategy ddp_ft [--tests /tmp/lightning-tests/tests]
    python compat/lightning_tests/run.py --compare         (tests that pass under ddp, not under ddp_ft)

The tests are Lightning's (tag 2.6.5, for the installed 2.6.6), extracted outside this repository
(README.md next to this file says how). Lightning's conftest runs as it is: its after-test
fixtures (leaked threads, environment variables, artifacts) count. ``force_strategy.py`` (a
pytest plugin, loaded with ``-p``) does the forcing and records per test the outcome of setup,
call and teardown; this script runs pytest, then counts:

- passed, failed (the body failed), errors in setup, errors in teardown (the body passed but an
  after-test fixture failed, e.g. Lightning's thread police), skipped, xfailed/xpassed.

Results: ``<out>/<strategy>/results.jsonl`` (one line per test), ``junit.xml``, ``pytest.log``,
``summary.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TESTS = Path("/tmp/lightning-tests/tests")
DEFAULT_OUT = Path("/tmp/lightning-compat")

#: the selection (relative to Lightning's tests/ directory): single-process CPU tests of the
#: training/evaluation loops, Trainer flags, logging from the loops, optimization, hooks and
#: checkpoint frequency; none needs a package beyond Lightning's own requirements installed here
SELECTION = [
    "tests_pytorch/loops",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/trainer/logging_",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/core/test_datamodules.py",
    "tests_pytorch/callbacks/test_timer.py",
    "tests_pytorch/callbacks/test_lr_monitor.py",
]
#: tests left out of the selection (-k): none by default
DESELECT_K: str | None = None


def classify(record: dict) -> str:
    """One outcome per test: passed, failed, error_setup, error_teardown, skipped, xfailed, xpassed."""
    setup, call, teardown = record.get("setup"), record.get("call"), record.get("teardown")
    if setup == "failed":
        return "error_setup"
    if setup == "skipped" or call == "skipped":
        return "skipped"
    if call == "failed":
        return "failed"
    if call in ("xfailed", "xpassed"):
        return call if teardown != "failed" else "error_teardown"
    if teardown == "failed":
        return "error_teardown"
    if call == "passed":
        return "passed"
    return "unknown"


def error_of(record: dict) -> tuple[str, str]:
    """(first line of the error that decided the outcome, where it was raised)."""
    for phase in ("setup", "call", "teardown"):
        if record.get(phase) == "failed":
            line, where = record.get(f"{phase}_error", ""), record.get(f"{phase}_where", "")
            if not line.split(":", 1)[-1].strip():  # a bare "AssertionError:": say where instead
                line = f"{line.strip()} at {where.rsplit('/', 1)[-1]}"
            return line, where
    return "", ""


_NORMALISE = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x…"),
    (re.compile(r"\b\d+(\.\d+)?\b"), "N"),
    (re.compile(r"/tmp/\S+"), "/tmp/…"),
    (re.compile(r"compat-\S+"), "compat-…"),
]


def group_key(line: str) -> str:
    for pattern, repl in _NORMALISE:
        line = pattern.sub(repl, line)
    return line[:200]


def load(path: Path) -> dict[str, dict]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["nodeid"]] = record
    return records


def summarise(records: dict[str, dict]) -> dict:
    counts = collections.Counter(classify(r) for r in records.values())
    forced = sum(1 for r in records.values() if r.get("forced"))
    return {"total": len(records), **{k: counts.get(k, 0) for k in (
        "passed", "failed", "error_setup", "error_teardown", "skipped", "xfailed", "xpassed", "unknown")},
        "tests_with_forced_trainer": forced}


def print_summary(name: str, summary: dict) -> None:
    print(f"[{name}] total {summary['total']}: passed {summary['passed']}, failed {summary['failed']}, "
          f"errors: setup {summary['error_setup']} / teardown {summary['error_teardown']} (body passed, an "
          f"after-test fixture failed), skipped {summary['skipped']}, xfailed {summary['xfailed']}, "
          f"xpassed {summary['xpassed']}; tests with a forced Trainer: {summary['tests_with_forced_trainer']}")


def run(args: argparse.Namespace) -> int:
    tests = args.tests.resolve()
    out = (args.out / args.strategy).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results, junit, log = out / "results.jsonl", out / "junit.xml", out / "pytest.log"
    env = dict(os.environ)
    paths = [str(HERE)]
    if args.deps and Path(args.deps).is_dir():
        paths.append(str(Path(args.deps).resolve()))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "pytest", "-c", str(HERE / "pytest.ini"), "--rootdir", str(tests),
           "-p", "no:cacheprovider", "-p", "force_strategy", "--force-strategy", args.strategy,
           "--force-results", str(results), "--observer-period", str(args.observer_period),
           f"--junitxml={junit}", "-q", "-rN", "--no-header", "-o", "console_output_style=classic"]
    try:
        import pytest_timeout  # noqa: F401

        cmd += ["--timeout", str(args.timeout)]
    except ImportError:
        print("pytest-timeout not installed: no per-test timeout")
    selection = args.select or SELECTION
    cmd += selection
    deselect = args.k or DESELECT_K
    if deselect:
        cmd += ["-k", deselect]
    cmd += args.pytest_args
    print("cwd:", tests)
    print("cmd:", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=tests, env=env, stdout=fh, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    records = load(results)
    summary = summarise(records)
    summary.update(strategy=args.strategy, pytest_exit_code=proc.returncode, seconds=round(elapsed, 1),
                   selection=selection, k=deselect, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"pytest exit code {proc.returncode} after {elapsed:.0f} s; log {log}; results {results}")
    print_summary(args.strategy, summary)
    not_ok = collections.Counter()
    for record in records.values():
        outcome = classify(record)
        if outcome in ("failed", "error_setup", "error_teardown"):
            not_ok[(outcome, group_key(error_of(record)[0]))] += 1
    if not_ok:
        print("\nnot passing, by first error line:")
        for (outcome, key), count in not_ok.most_common():
            print(f"  {count:4d}  {outcome:15s} {key}")
    return 0


def compare(args: argparse.Namespace) -> int:
    base = load(args.out / "ddp" / "results.jsonl")
    other = load(args.out / "ddp_ft" / "results.jsonl")
    if not base or not other:
        print(f"need both {args.out}/ddp/results.jsonl and {args.out}/ddp_ft/results.jsonl")
        return 2
    print_summary("ddp", summarise(base))
    print_summary("ddp_ft", summarise(other))
    groups: dict[str, list[tuple[str, str, dict]]] = collections.defaultdict(list)
    missing = []
    for nodeid, record in base.items():
        if classify(record) != "passed":
            continue
        theirs = other.get(nodeid)
        if theirs is None:
            missing.append(nodeid)
            continue
        outcome = classify(theirs)
        if outcome in ("passed", "skipped", "xfailed"):
            continue
        line, _ = error_of(theirs)
        groups[f"{outcome}: {group_key(line)}"].append((nodeid, outcome, theirs))
    total = sum(len(v) for v in groups.values())
    print(f"\n{total} tests pass under ddp but not under ddp_ft ({len(missing)} did not run under ddp_ft):")
    for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        nodeid, outcome, record = items[0]
        line, where = error_of(record)
        print(f"\n[{len(items)}] {key}")
        print(f"    e.g. {nodeid}")
        print(f"         {where}: {line[:300]}")
        if args.verbose:
            for nodeid, _, _ in items[1:]:
                print(f"         {nodeid}")
    better = [n for n, r in other.items() if classify(r) == "passed" and n in base and classify(base[n]) != "passed"]
    print(f"\n{len(better)} tests pass under ddp_ft but not under ddp" + (":" if better else ""))
    for nodeid in better:
        print(f"    {nodeid}  (ddp: {classify(base[nodeid])}: {group_key(error_of(base[nodeid])[0])})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("ddp", "ddp_ft", "none"))
    parser.add_argument("--compare", action="store_true", help="tests that pass under ddp but not under ddp_ft")
    parser.add_argument("--tests", type=Path, default=DEFAULT_TESTS, help="Lightning's tests/ directory")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results go to OUT/<strategy>/")
    parser.add_argument("--deps", default=None, help="a directory put on PYTHONPATH (pip install --target) for "
                        "test dependencies not in the venv (the default selection needs none)")
    parser.add_argument("--timeout", type=int, default=120, help="per-test timeout (pytest-timeout)")
    parser.add_argument("--observer-period", type=float, default=0.05,
                        help="see force_strategy.py (<= 0: Lightning's 5 s)")
    parser.add_argument("--select", nargs="*", default=None, help="paths instead of the built-in selection")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="--compare: list every test of each group")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    if not args.strategy:
        parser.error("--strategy or --compare")
    if not (args.tests / "tests_pytorch" / "conftest.py").exists():
        parser.error(f"{args.tests} is not Lightning's tests/ directory (see README.md)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
