"""Characterization record of the multi-process tests: each participant's exit code and the
decisions in its event log, per test, compared with ``tests/characterization.json``.

Every test that makes a :class:`ft_cluster.Cluster` is recorded at the end of its body (if the
test passed; tests/conftest.py calls :func:`check`): for each process the test started through
its clusters' process sets (the stores excepted), its exit code and a *normalized* sequence of
the events its process wrote to the run's event log. A difference from the stored record fails
the test with the record expected and the one seen, participant by participant. No process is
started for it: it reads what the test's own processes left.

Normalization (:func:`normalize`) keeps what the code *decides* and drops what timing decides
(kept: only what was the same in each of several runs of every covered test, idle and loaded):

* only the events in :data:`KEEP`, each with only the fields listed there: no step a fault or a
  signal happened to land on (``restored`` says only whether it resumed from a snapshot), no
  rank (ranks follow the order of arrival), no duration, no free text (``reason``, ``error``:
  ids, ports, wording); snapshot transfers and plans, replicas, the durable tier's uploads and
  the snapshot schedule are dropped (their number follows the step times);
* consecutive equal entries collapse into one (a failure seen by two threads);
* :data:`UNORDERED` events (the health report, from a thread of its own) are a set per
  participant, not part of the sequence;
* ``round_open`` is a set for the whole test (``"rounds_opened"``): every process that asks for
  the next round writes one, and which waiting spare notices first that the actives went silent
  is a race;
* exit codes as ``Popen.returncode`` (``-N``: killed by signal N); ``null`` for a process still
  running when the test ended (one that is being killed is waited for).

A test whose roles depend on the order of arrival (``cluster.start(["A", "B", "C"])``: whoever
arrives first is active) is compared as a multiset of participants (``"names": false``): its
records must match one to one, whichever name each one has. A participant whose outcome the
test itself accepts in more than one form (e.g. 143 or 81) has ``"one_of"``: a list of records,
any of which matches; an option without ``"events"`` compares the exit code only (an outcome
the test accepts but no run was seen to take); ``"rounds_opened": {"one_of": [...]}`` likewise.
``"ignore": {"name": "reason"}`` leaves a process out that is no participant of the job and
whose end is timing (the forger of the trust tests, which runs until its store is gone).
``"note"`` says why an entry has alternatives. A test left out on purpose has ``"skip": "reason"``.
A test that makes a ``Cluster`` and has no record fails, saying how to record it.

Regenerate after a deliberate change (``"names"``, ``"ignore"``, ``"note"``, ``"skip"`` and ``"one_of"``
alternatives the new record still matches are kept; review the diff of the JSON file like code)::

    LIGHTNING_FT_UPDATE_CHARACTERIZATION=1 python -m pytest -n 2 tests/test_fault_matrix.py ...

``LIGHTNING_FT_CHARACTERIZATION_DUMP=DIR`` additionally writes each test's raw observation
(every event with every field, exit codes) to ``DIR``, one JSON file per test.
"""

from __future__ import annotations

import difflib
import fcntl
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ft_cluster  # noqa: F401 - conftest.py reads characterization.ft_cluster.CREATED

GOLDEN = Path(__file__).resolve().with_name("characterization.json")
UPDATE_ENV = "LIGHTNING_FT_UPDATE_CHARACTERIZATION"
DUMP_ENV = "LIGHTNING_FT_CHARACTERIZATION_DUMP"

def _step_above_0(record: dict) -> bool:
    return (record.get("step") or 0) > 0


#: event -> the fields kept, in this order (a name, or (label, function of the event)); every
#: other event is dropped. Only fields that are the same in every run: no step a failure or a
#: signal happened to land on (``restored`` keeps only whether it resumed from a snapshot or
#: from step 0), no rank (ranks follow the order of arrival), no durations, no free text
#: (``reason``, ``error``: ids, ports and wording).
KEEP: dict[str, tuple] = {
    "join": (),
    "round_complete": ("round", "world", "standby"),
    "group_formed": ("round",),
    "snapshot_received": ("round",),
    "restored": ("round", ("step>0", _step_above_0)),
    "failure_detected": ("round", "detector"),
    "decision": ("round", "kind", "action"),
    "first_step_after_recovery": ("round",),
    "spare_exit": (),
    "no_restart": ("round",),
    "node_fault": ("round", "errno"),
    "stopped": ("round",),
    "finished": ("round", "step"),
    "termination_signal": ("signal",),
    "stop_agreed": (),
    "termination_decision": ("action", "exit_code", "tier"),
    "unhealthy_exit": ("exit_code",),
    "evicted": ("round",),
    "hand_over_verdict": ("hands_over", "leaving"),
    "handed_over": ("round",),
    "hand_over": ("round",),
    "grow": ("round",),
}
#: events kept as a set per participant, not in the sequence: they come from a thread of their
#: own, in no fixed order with the others (the health check runs while the ranks agree on the
#: stop step)
UNORDERED: dict[str, tuple] = {
    "health_report": ("healthy",),
}
#: ``round_open`` is written by every process that asks for the next round, and which of the
#: waiting spares notices first that the actives went silent is a race: it is kept for the test
#: as a whole, as the set of rounds opened ("1 after 0"), not per participant


# ------------------------------------------------------------------------------- observing


def record_key(nodeid: str) -> str:
    """The record's key: the node id without pytest-xdist's ``@group`` suffix."""
    return nodeid.split("@", 1)[0]


def _dying(pid: int) -> bool:
    """True if the process is gone or on its way out (its exit status is about to be known):
    no /proc entry, a zombie, exiting (PF_EXITING), or a SIGKILL pending (a fatal signal is
    delivered as one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & 0x4:
        return True
    kill = 1 << (signal.SIGKILL - 1)
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & kill:
            return True
    return False


def exit_code(proc: Any, patience: float = 30.0) -> int | None:
    """The process's exit code; ``None`` if it is alive and not dying (a process killed just
    before the test ended is waited for, so that the code does not depend on how fast it is
    reaped)."""
    code = proc.popen.poll()
    deadline = time.monotonic() + patience
    while code is None and _dying(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
        code = proc.popen.poll()
    return code


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn by SIGKILL mid-write
    return records


def observe(clusters: list) -> dict[str, dict]:
    """participant -> {"exit": code, "events": [every event of its process, in the order written]}.

    Participants: every process of the clusters' process sets except their stores, named as in
    the test (``<i>/<name>`` when the test used several process sets, ``i`` in order of use)."""
    launchers: list = []
    stores: set[int] = set()
    for cluster in clusters:
        if not any(launcher is cluster.launcher for launcher in launchers):
            launchers.append(cluster.launcher)
        stores.update(id(proc) for proc in cluster.stores.values())
    procs: dict[str, Any] = {}
    for index, launcher in enumerate(launchers):
        for name, proc in getattr(launcher, "procs", {}).items():
            if id(proc) not in stores:
                procs[name if len(launchers) == 1 else f"{index}/{name}"] = proc
    codes = {key: exit_code(proc) for key, proc in procs.items()}
    by_pid = {proc.pid: key for key, proc in procs.items()}
    found: dict[str, list] = {key: [] for key in procs}
    seen: set[Path] = set()
    for cluster in clusters:
        directory = Path(cluster.events)
        if directory in seen or not directory.is_dir():
            continue
        seen.add(directory)
        for file_index, path in enumerate(sorted(directory.glob("events-*.jsonl"))):
            for line_index, record in enumerate(_read_jsonl(path)):
                key = by_pid.get(record.get("pid"))
                if key is not None:  # one process writes in order of its monotonic clock
                    found[key].append(((record.get("mono", 0.0), str(directory), file_index, line_index), record))
    return {key: {"exit": codes[key], "events": [record for _, record in sorted(found[key], key=lambda x: x[0])]}
            for key in procs}


# ------------------------------------------------------------------------------ normalizing


def _value(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def _entry(record: dict, fields: tuple) -> str:
    parts = [record["event"]]
    for spec in fields:
        label, value = (spec, record.get(spec)) if isinstance(spec, str) else (spec[0], spec[1](record))
        parts.append(f"{label}={_value(value)}")
    return " ".join(parts)


def normalize_events(events: list[dict]) -> tuple[list[str], list[str]]:
    """(the kept events in order, consecutive equal ones collapsed; the unordered ones, a sorted set)."""
    ordered: list[str] = []
    unordered: set[str] = set()
    for record in events:
        name = record.get("event")
        if name in KEEP:
            entry = _entry(record, KEEP[name])
            if not ordered or ordered[-1] != entry:
                ordered.append(entry)
        elif name in UNORDERED:
            unordered.add(_entry(record, UNORDERED[name]))
    return ordered, sorted(unordered)


def normalize(observation: dict[str, dict]) -> dict:
    """A test's record: per participant its exit code and normalized events; the rounds opened."""
    participants = {}
    for key, seen in observation.items():
        ordered, unordered = normalize_events(seen["events"])
        participants[key] = {"exit": seen["exit"], "events": ordered, **({"unordered": unordered} if unordered else {})}
    opened = {(e.get("round"), e.get("after")) for seen in observation.values() for e in seen["events"]
              if e.get("event") == "round_open"}
    return {"participants": participants,
            "rounds_opened": [f"{new} after {failed}" for new, failed in sorted(opened, key=_round_order)]}


def _round_order(pair: tuple) -> tuple:
    return tuple((value is None, value if isinstance(value, int) else 0, str(value)) for value in pair)


# ------------------------------------------------------------------------------- comparing


def _options(expected: dict) -> list[dict]:
    return expected["one_of"] if "one_of" in expected else [expected]


def _option_matches(option: dict, got: dict) -> bool:
    """An option without ``events`` compares the exit code only."""
    return option["exit"] == got["exit"] and ("events" not in option or (
        option["events"] == got["events"] and option.get("unordered", []) == got.get("unordered", [])))


def _matches(expected: dict, got: dict) -> bool:
    return any(_option_matches(option, got) for option in _options(expected))


def _lines(record: dict, indent: str = "    ") -> list[str]:
    if "events" not in record:
        return [f"{indent}(events not compared)"]
    return ([f"{indent}{e}" for e in record["events"]]
            + [f"{indent}{e} (in any order)" for e in record.get("unordered", [])])


def _describe(expected: dict | None, got: dict | None, title: str) -> list[str]:
    lines = [title]
    if got is None:
        return lines + ["  not seen; expected: exit " + " or ".join(str(o["exit"]) for o in _options(expected))]
    if expected is None:
        return lines + [f"  not expected; seen: exit {got['exit']}, events:", *_lines(got)]
    options = _options(expected)
    for number, option in enumerate(options):
        prefix = f"  (alternative {number + 1} of {len(options)}) " if len(options) > 1 else "  "
        if option["exit"] != got["exit"]:
            lines.append(f"{prefix}exit code: expected {option['exit']}, got {got['exit']}")
        if "events" in option:
            want = _lines(option, "")
            seen = _lines(got, "")
            if want != seen:
                lines.append(f"{prefix}events (- expected, + got):")
                lines += ["    " + line for line in difflib.unified_diff(want, seen, lineterm="", n=100)][2:]
    return lines


def differences(entry: dict, got: dict) -> list[str]:
    """Lines saying how the record ``got`` differs from the stored ``entry`` (empty: it matches)."""
    lines: list[str] = []
    rounds = entry.get("rounds_opened", [])
    if got["rounds_opened"] not in (rounds["one_of"] if isinstance(rounds, dict) else [rounds]):
        wanted = " or ".join(map(str, rounds["one_of"])) if isinstance(rounds, dict) else rounds
        lines.append(f"rounds opened: expected {wanted}, got {got['rounds_opened']}")
    ignored = entry.get("ignore", {})
    expected: dict[str, dict] = entry["participants"]
    seen: dict[str, dict] = {key: record for key, record in got["participants"].items() if key not in ignored}
    if entry.get("names", False):
        for key in [*expected, *(k for k in seen if k not in expected)]:
            if key in expected and key in seen and _matches(expected[key], seen[key]):
                continue
            lines += _describe(expected.get(key), seen.get(key), f"participant {key}:")
        return lines
    # names do not matter (roles by arrival): a one-to-one matching of the stored records to the seen ones
    exp_keys, seen_keys = list(expected), list(seen)
    if len(exp_keys) == len(seen_keys) and any(
            all(_matches(expected[e], seen[g]) for e, g in zip(exp_keys, order, strict=True))
            for order in itertools.permutations(seen_keys)):
        return lines
    lines.append("participants (compared whatever their names: no one-to-one match):")
    for key in seen_keys:
        lines += [f"  seen as {key}: exit {seen[key]['exit']}", *_lines(seen[key])]
    for key in exp_keys:
        for number, option in enumerate(_options(expected[key])):
            alt = f" (alternative {number + 1})" if "one_of" in expected[key] else ""
            lines += [f"  expected (stored as {key}){alt}: exit {option['exit']}", *_lines(option)]
    return lines


# ------------------------------------------------------------------------------- the record

_golden_cache: dict | None = None


def load() -> dict:
    global _golden_cache
    if _golden_cache is None:
        _golden_cache = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    return _golden_cache


def _updated_entry(old: dict | None, got: dict) -> dict:
    """The new entry of a test: the stored one if the record seen still matches it; else the
    record seen, keeping the stored ``names`` flag (new entries: false, names do not matter; set
    it to true by hand where the test pins the roles), ``ignore`` and the ``one_of``
    alternatives the record still matches."""
    old = old or {}
    if "skip" in old or old.get("participants") and not differences(old, got):
        return old  # still matches: kept as it is (no churn of names where names do not matter)
    names = old.get("names", False)
    ignored = old.get("ignore", {})
    stored = old.get("participants", {})
    participants = {}
    for key, record in got["participants"].items():
        if key in ignored:
            continue
        candidates = [stored[key]] if names and key in stored else list(stored.values())
        kept = next((c for c in candidates if "one_of" in c and _matches(c, record)), None)
        participants[key] = kept if kept is not None else record
    rounds = old.get("rounds_opened")
    if not (isinstance(rounds, dict) and got["rounds_opened"] in rounds["one_of"]):
        rounds = got["rounds_opened"]
    return {**({"note": old["note"]} if "note" in old else {}), "names": names,
            **({"ignore": ignored} if ignored else {}), "participants": participants, "rounds_opened": rounds}


def store(key: str, got: dict) -> None:
    """Write this test's record into the file (under a lock: pytest-xdist workers share it)."""
    with open(Path(tempfile.gettempdir()) / "lightning-ft-characterization.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        records[key] = _updated_entry(records.get(key), got)
        tmp = GOLDEN.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n")
        os.replace(tmp, GOLDEN)


def dump(key: str, observation: dict) -> None:
    directory = Path(os.environ[DUMP_ENV])
    directory.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    (directory / f"{safe}.json").write_text(json.dumps({"test": key, "participants": observation}, default=str))


def check(nodeid: str, clusters: list) -> None:
    """Record (``LIGHTNING_FT_UPDATE_CHARACTERIZATION=1``) or compare this test's participants;
    a difference fails the test, naming it participant by participant."""
    if not clusters:
        return
    key = record_key(nodeid)
    observation = observe(clusters)
    if os.environ.get(DUMP_ENV):
        dump(key, observation)
    got = normalize(observation)
    if os.environ.get(UPDATE_ENV):
        store(key, got)
        return
    entry = load().get(key)
    if entry is None:
        pytest.fail(f"no characterization record for {key} in tests/{GOLDEN.name}: record it with "
                    f"{UPDATE_ENV}=1 (see tests/characterization.py)", pytrace=False)
    if "skip" in entry:
        return
    lines = differences(entry, got)
    if lines:
        pytest.fail(f"the participants of this test ended differently from its characterization record "
                    f"(tests/{GOLDEN.name}; if the change is deliberate, regenerate it with {UPDATE_ENV}=1 "
                    "and review the diff):\n" + "\n".join(lines), pytrace=False)
