"""The decisions about the model a stage starts from (runtime/stage_state.py) and the job's stages
in the run's records (rendezvous/stages.py), on a real TCPStore where records are involved."""

from __future__ import annotations

import json
import types

import pytest

from lightning_ft._lightning.trainer import replace_checkpoint_path
from lightning_ft.runtime.stage_state import (
    NO_FIT,
    FitCheckpointPaths,
    checkpoint_path_for,
    newest_state_source,
)

from proc_utils import REPO_ROOT

ALIGN_STATE = REPO_ROOT / "tests" / "scripts" / "align_state.py"
PUBLISHED = FitCheckpointPaths(stage=2, best="/ckpt/best.ckpt", last="/ckpt/last.ckpt")


def test_published_paths_round_trip_and_garbage_is_none():
    assert FitCheckpointPaths.decode(PUBLISHED.encode()) == PUBLISHED
    for raw in (b"", b"{", b"[]", b'{"stage": "x", "best": "", "last": ""}', b'{"best": ""}'):
        assert FitCheckpointPaths.decode(raw) is None, raw


@pytest.mark.parametrize("requested, model_given, trained_through, expected", [
    ("best", True, NO_FIT, "/ckpt/best.ckpt"),  # stood by in the fit: the published path
    ("last", True, 1, "/ckpt/last.ckpt"),
    (None, False, NO_FIT, "/ckpt/best.ckpt"),  # no model given: Lightning's implicit "best"
    (None, True, NO_FIT, None),  # a model given: Lightning uses it as it is (the state is aligned)
    ("best", True, 2, "best"),  # finished that fit as an active: Lightning resolves it itself
    ("/my/path.ckpt", True, NO_FIT, "/my/path.ckpt"),  # an explicit path is the user's
])
def test_a_process_that_stood_by_takes_the_published_checkpoint_path(requested, model_given, trained_through,
                                                                     expected):
    assert checkpoint_path_for(requested, model_given, PUBLISHED, trained_through) == expected


def test_without_published_or_with_empty_paths_the_request_stands():
    assert checkpoint_path_for("best", True, None, NO_FIT) == "best"
    empty = FitCheckpointPaths(stage=0, best="", last="")
    assert checkpoint_path_for("best", True, empty, NO_FIT) == "best"  # Lightning says what is missing


@pytest.mark.parametrize("versions, source", [
    ([0, 0, 0], None), ([NO_FIT], None), ([NO_FIT, 0], 1), ([2, NO_FIT, 2], 0), ([0, 2, 2], 1),
])
def test_the_source_of_the_module_state_is_the_lowest_rank_with_the_newest_fit(versions, source):
    assert newest_state_source(versions) == source


@pytest.mark.parametrize("fn, position", [("fit", 4), ("validate", 2), ("test", 2), ("predict", 4)])
def test_the_checkpoint_path_is_replaced_where_lightning_passes_it(fn, position):
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(fn=types.SimpleNamespace(value=fn)))
    args = tuple(f"arg{i}" for i in range(6))
    seen = []

    def choose(requested, model_given):
        seen.append((requested, model_given))
        return "chosen"

    replaced = replace_checkpoint_path(trainer, args, choose)
    assert seen == [(f"arg{position}", True)]
    assert replaced[position] == "chosen" and replaced[:position] == args[:position]
    assert replaced[position + 1:] == args[position + 1:]
    assert replace_checkpoint_path(trainer, args[:position], choose) == args[:position]  # no such argument


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_behind_receive_parameters_and_buffers_from_the_newest(processes, port, tmp_path):
    """Three real gloo ranks; ranks 1 and 2 trained through fit stage 2, rank 0 stood by: every
    rank ends with rank 1's parameters and buffers, and says so. Each rank is a process of its own
    (tests/scripts/align_state.py, forked from the preloaded server: tests/prefork.py)."""
    versions = [NO_FIT, 2, 2]
    for rank in range(3):
        processes.python(f"rank{rank}", [str(ALIGN_STATE), str(rank), "3", str(port), str(versions[rank]),
                                         str(tmp_path / f"rank{rank}.json")])
    codes = processes.wait_all(timeout=100)
    assert codes == {"rank0": 0, "rank1": 0, "rank2": 0}, processes.dump_logs()
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)}
    assert all(result["received"] == [1, 2] for result in results.values()), results
    assert results[0]["state"] == results[1]["state"] == results[2]["state"]
