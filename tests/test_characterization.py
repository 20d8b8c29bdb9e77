"""The characterization record itself (tests/characterization.json, tests/characterization.py):
it covers the fault matrix's scenarios, every key names a test that exists (a renamed test
cannot silently drop out), and the comparison does what the record's format promises. No
process is started here."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import characterization as ch

REPO_ROOT = Path(__file__).resolve().parents[1]
#: scenarios with a record (not skipped); lower it only together with a reason in the changelog
MIN_SCENARIOS = 45


def _records() -> dict:
    return json.loads(ch.GOLDEN.read_text())


def _parametrize_ids(decorator: ast.expr) -> list[str] | None:
    """The ids of ``@pytest.mark.parametrize(names, [literal values])``; None for another decorator."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "parametrize"):
        return None
    values = ast.literal_eval(decorator.args[1])
    return ["-".join(map(str, value)) if isinstance(value, tuple) else str(value) for value in values]


def existing_tests(path: Path) -> set[str]:
    """Node ids of the test functions of a module, parametrized ones with each id (literal values)."""
    tree = ast.parse(path.read_text())
    found = set()
    prefix = path.relative_to(REPO_ROOT).as_posix()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            ids = [i for i in map(_parametrize_ids, node.decorator_list) if i is not None]
            assert len(ids) <= 1, f"{prefix}::{node.name}: stacked parametrize is not read here"
            if ids:
                found |= {f"{prefix}::{node.name}[{one}]" for one in ids[0]}
            else:
                found.add(f"{prefix}::{node.name}")
    return found


def test_the_record_covers_the_scenarios_of_the_fault_matrix():
    records = _records()
    recorded = [key for key, entry in records.items() if "skip" not in entry]
    assert len(recorded) >= MIN_SCENARIOS, f"{len(recorded)} scenarios recorded, fewer than {MIN_SCENARIOS}"
    files = {key.split("::")[0] for key in recorded}
    for name in ("test_fault_matrix.py", "test_exit_truth.py", "test_strategy_multiprocess.py"):
        assert f"tests/{name}" in files, name


def test_every_key_names_an_existing_test():
    records = _records()
    tests: dict[str, set[str]] = {}
    missing = []
    for key in records:
        path = REPO_ROOT / key.split("::")[0]
        if path.is_file() and path.name not in tests:
            tests[path.name] = existing_tests(path)
        if key not in tests.get(path.name, ()):
            missing.append(key)
    assert not missing, f"records of tests that do not exist (renamed? update {ch.GOLDEN.name}): {missing}"


def test_every_record_is_well_formed():
    for key, entry in _records().items():
        if "skip" in entry:
            assert isinstance(entry["skip"], str) and entry["skip"], key
            continue
        assert set(entry) <= {"note", "names", "ignore", "participants", "rounds_opened"}, key
        assert isinstance(entry.get("note", ""), str), key
        assert all(isinstance(reason, str) and reason for reason in entry.get("ignore", {}).values()), key
        assert isinstance(entry["names"], bool) and entry["participants"], key
        rounds = entry["rounds_opened"]
        for option in rounds["one_of"] if isinstance(rounds, dict) else [rounds]:
            assert all(isinstance(r, str) for r in option), key
        for name, participant in entry["participants"].items():
            for option in participant["one_of"] if "one_of" in participant else [participant]:
                assert option["exit"] is None or isinstance(option["exit"], int), (key, name)
                assert set(option) <= {"exit", "events", "unordered"}, (key, name)
                assert all(isinstance(e, str) for e in option.get("events", [])), (key, name)


# ------------------------------------------------------------------------ the comparison


def _event(name: str, **fields) -> dict:
    return {"t": 0.0, "mono": 0.0, "pid": 1, "who": "x", "event": name, **fields}


def _observation() -> dict:
    active = [_event("join", participant="p:1"), _event("round_complete", round=0, rank=1, world=2, standby=False),
              _event("snapshot_plan", round=0, step=None), _event("group_formed", round=0, rank=1, seconds=0.1),
              _event("health_report", healthy=True, reasons=[]),
              _event("failure_detected", round=0, step=37, detector="collective", error="reset"),
              _event("failure_detected", round=0, step=37, detector="collective", error="reset again"),
              _event("decision", round=0, kind="peer_lost", action="recover", reason="..."),
              _event("round_open", round=1, after=0, reason="peer_lost"),
              _event("restored", round=1, step=30), _event("finished", round=1, rank=0, step=100, seconds=3.2)]
    spare = [_event("join"), _event("round_complete", round=0, rank=-1, world=2, standby=True),
             _event("round_open", round=1, after=0, reason="silent"),
             _event("round_complete", round=1, rank=1, world=2, standby=False), _event("restored", round=1, step=0),
             _event("finished", round=1, rank=1, step=100)]
    return {"A": {"exit": 0, "events": active}, "B": {"exit": 0, "events": spare}, "C": {"exit": -9, "events": []}}


def test_normalize_keeps_decisions_and_drops_what_timing_decides():
    record = ch.normalize(_observation())
    assert record["rounds_opened"] == ["1 after 0"]
    a = record["participants"]["A"]
    assert a["events"] == ["join", "round_complete round=0 world=2 standby=false", "group_formed round=0",
                           "failure_detected round=0 detector=collective",  # twice in a row: once
                           "decision round=0 kind=peer_lost action=recover",
                           "restored round=1 step>0=true", "finished round=1 step=100"]
    assert a["unordered"] == ["health_report healthy=true"]
    assert "restored round=1 step>0=false" in record["participants"]["B"]["events"]
    assert record["participants"]["C"] == {"exit": -9, "events": []}


@pytest.mark.parametrize("names", [True, False])
def test_a_record_matches_itself_and_names_matter_only_when_pinned(names):
    record = ch.normalize(_observation())
    entry = {"names": names, **record}
    assert ch.differences(entry, record) == []
    swapped = {**record, "participants": {"A": record["participants"]["B"], "B": record["participants"]["A"],
                                          "C": record["participants"]["C"]}}
    lines = ch.differences(entry, swapped)
    assert bool(lines) == names
    if names:
        assert "participant A:" in lines and "participant B:" in lines


def test_a_difference_is_shown_participant_by_participant():
    record = ch.normalize(_observation())
    entry = {"names": True, **json.loads(json.dumps(record))}
    changed = json.loads(json.dumps(record))
    changed["participants"]["A"]["exit"] = 83
    changed["participants"]["A"]["events"][-1] = "no_restart round=1"
    text = "\n".join(ch.differences(entry, changed))
    assert "participant A:" in text and "exit code: expected 0, got 83" in text
    assert "-finished round=1 step=100" in text and "+no_restart round=1" in text
    assert "participant B" not in text


def test_one_of_accepts_each_alternative_and_an_exit_only_option():
    record = ch.normalize(_observation())
    entry = {"names": True, **json.loads(json.dumps(record))}
    entry["participants"]["C"] = {"one_of": [{"exit": -9, "events": []}, {"exit": 143}]}
    for code, events in ((-9, []), (143, ["join", "stopped round=0"])):
        got = json.loads(json.dumps(record))
        got["participants"]["C"] = {"exit": code, "events": events}
        assert ch.differences(entry, got) == [], code
    got["participants"]["C"] = {"exit": 81, "events": []}
    assert "participant C:" in ch.differences(entry, got)
    # regenerating keeps the alternatives while the record seen is one of them
    assert ch._updated_entry(entry, record)["participants"]["C"] == entry["participants"]["C"]
    changed = json.loads(json.dumps(record))
    changed["participants"]["A"]["exit"] = 1
    assert ch._updated_entry(entry, changed)["participants"] == {**changed["participants"],
                                                                 "C": entry["participants"]["C"]}


def test_rounds_opened_may_have_alternatives():
    record = ch.normalize(_observation())
    entry = {"names": True, **record, "rounds_opened": {"one_of": [[], ["1 after 0"]]}}
    assert ch.differences(entry, record) == []
    assert ch.differences(entry, {**record, "rounds_opened": ["2 after 1"]}) == [
        "rounds opened: expected [] or ['1 after 0'], got ['2 after 1']"]


def test_regenerating_keeps_an_entry_that_still_matches():
    record = ch.normalize(_observation())
    entry = {"names": False, **record}
    swapped = {**record, "participants": {"A": record["participants"]["B"], "B": record["participants"]["A"],
                                          "C": record["participants"]["C"]}}
    assert ch._updated_entry(entry, swapped) is entry
    assert ch._updated_entry(None, record) == {"names": False, **record}


def test_the_xdist_group_suffix_is_not_part_of_the_key():
    assert ch.record_key("tests/test_x.py::test_y[a]@slurm-reference") == "tests/test_x.py::test_y[a]"
