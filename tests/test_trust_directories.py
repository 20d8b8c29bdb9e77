"""Directories another local user can reach (issue 24, findings 5 and 6): the exit-code wrapper's
``--dir`` and the durable directory (``persist_to``), with real processes and a real other user
(children running as uid 65534 in a shared, sticky directory like /tmp). Also: what a durable
manifest says is checked before it names a path, and sealed with the job secret."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint.durable.targets import LocalDirTarget, open_target
from lightning_ft.checkpoint.durable.tier import DurableTier
from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory.store import SnapshotStore

from proc_utils import REPO_ROOT, child_env, wait_for

NOBODY = 65534
JOB = str(REPO_ROOT / "tests" / "scripts" / "snapshot_job.py")
RUN_ID_VARS = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LIGHTNING_FT_SECRET",
               "LIGHTNING_FT_SECRET_FILE")
#: what another user plants where the exit-code wrapper reads: "rank 0 saved its state"
PLANTED_RECORD = {"rank": 0, "exit_code": 81, "action": "save-then-exit", "reasons": ["planted"], "step": 1}


@pytest.fixture
def shared_tmp():
    """A directory every user may create entries in, with the sticky bit: a shared /tmp."""
    path = Path(tempfile.mkdtemp(prefix="lightning-ft-shared-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_other_user(action, timeout: float = 30) -> None:
    """Run ``action()`` in a forked child that became uid/gid 65534 with no supplementary groups:
    another local user, whose every file operation the kernel checks as such. Killed (by pid) at
    ``timeout``; its exception, if any, fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no logging, no printing (locks of the parent's threads), only os calls
        os.close(read_end)
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
        except BaseException:  # noqa: BLE001 - reported to the parent
            os.write(write_end, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write_end)
    try:
        assert wait_for(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0), timeout, interval=0.01), \
            f"the other user's action did not finish within {timeout} s"
    except BaseException:
        _kill_quietly(pid)
        raise
    finally:
        with os.fdopen(read_end, "rb") as pipe:
            error = pipe.read().decode()
    assert not error, f"as uid {NOBODY}:\n{error}"


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _mkdir(path: Path, mode: int):
    def make() -> None:
        os.mkdir(path)
        os.chmod(path, mode)  # the mode asked for, whatever the umask
    return make


def _plant_launch(directory: Path, name: str) -> None:
    os.mkdir(directory / name, 0o755)
    (directory / name / "rank-0.json").write_text(json.dumps(PLANTED_RECORD))


def _plant_records(directory: Path):
    """Replace every launch directory in ``directory`` by one of the other user's with a planted record."""
    def plant() -> None:
        for name in _launch_dirs(directory):
            os.rename(directory / name, directory / f"moved-{name}")
            _plant_launch(directory, name)
    return plant


def _take_over(path: Path):
    """Move ``path`` aside (its parent is the other user's) and put a directory of theirs in its
    place, with a planted record in each launch directory it had."""
    def take() -> None:
        taken = path.with_name(path.name + ".taken")
        os.rename(path, taken)
        os.mkdir(path, 0o755)
        for name in _launch_dirs(taken):
            _plant_launch(path, name)
    return take


def _launch_dirs(directory: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith("launch-"))
    except OSError:
        return []


# ------------------------------------------------------------------------------- the exit-code wrapper

#: a launcher that crashes (exit 1, no record of its own) once told to: ARGV = ran-marker go-file
CRASHING_LAUNCHER = ("import os, sys, time, pathlib; pathlib.Path(sys.argv[1]).write_text(str(os.getpid()));"
                     "end = time.monotonic() + 60\n"
                     "while not os.path.exists(sys.argv[2]) and time.monotonic() < end: time.sleep(0.02)\n"
                     "sys.exit(1)")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["created-first", "symlink", "taken-over"])
def test_the_exit_code_wrapper_never_reports_0_or_81_from_a_directory_another_user_controls(
        processes, tmp_path, shared_tmp, how):
    """Another user (a) creates the fixed --dir first, (b) makes it a symlink to a directory of
    theirs, or (c) owns the parent of this user's --dir (0755) and puts a directory of theirs in
    its place while the launcher runs; then plants "rank 0 saved (81)" where the wrapper reads.
    The launcher crashes. The old wrapper exited 81; now it refuses (a, b) before starting the
    launcher, or (c) the records, with a message naming the directory, and exits 83."""
    records = shared_tmp / "ft-exit"
    reads_from = records  # where the launch directories appear
    if how == "created-first":
        as_other_user(_mkdir(records, 0o755))
    elif how == "symlink":
        reads_from = shared_tmp / "theirs"
        as_other_user(_mkdir(reads_from, 0o755))
        as_other_user(lambda: os.symlink(reads_from, records))
    else:
        parent = shared_tmp / "their-parent"
        as_other_user(_mkdir(parent, 0o755))
        records = reads_from = parent / "ft-exit"
        records.mkdir()
        os.chmod(records, 0o755)  # this user's and private (nobody else can write it): accepted at the start
    ran, go = tmp_path / "launcher-ran", tmp_path / "go"
    wrapper = processes.python("wrapper", ["-m", "lightning_ft.cli", "exit-code", "--dir", str(records), "--",
                                           sys.executable, "-c", CRASHING_LAUNCHER, str(ran), str(go)])
    try:
        assert wait_for(lambda: ran.exists() or wrapper.popen.poll() is not None, 60), processes.dump_logs()
        if ran.exists():  # the launcher runs: the other user swaps in records of its making meanwhile
            assert wait_for(lambda: _launch_dirs(reads_from), 10), processes.dump_logs()
            as_other_user(_take_over(records) if how == "taken-over" else _plant_records(reads_from))
        go.touch()
        code = wrapper.popen.wait(timeout=60)
    finally:
        if ran.exists() and ran.read_text():
            _kill_quietly(int(ran.read_text()))
    log = wrapper.log()
    assert code not in (0, 81), log
    assert code == 83, log
    if how == "taken-over":
        assert "its rank records are not read" in log and f"exit record directory '{records}'" in log, log
        assert f"owned by uid {NOBODY}" in log, log
    else:
        assert not ran.exists(), "the launcher was started with records another user controls"
        assert f"exit record directory '{records}'" in log and "Not running the launcher; exiting 83" in log, log
        assert (f"owned by uid {NOBODY}" if how == "created-first" else "is a symbolic link") in log, log


def test_with_untrusted_records_only_a_launcher_that_succeeded_ends_0():
    from lightning_ft.termination.exit_records import code_without_records

    assert code_without_records(0) == 0
    assert [code_without_records(c) for c in (1, 81, 82, 143)] == [83, 83, 83, 83]


# ------------------------------------------------------------------------------- the durable directory


def _job(processes, name: str, tmp_path: Path, durable: Path, args: list[str], expect_code: int = 0,
         **env: str) -> tuple[dict | None, str]:
    """snapshot_job.py with ``--persist-to durable`` and a fresh snapshot root (a new node): (result, log)."""
    run_env = child_env()
    for var in RUN_ID_VARS:
        run_env.pop(var, None)
    run_env.update(env)
    out = tmp_path / f"out-{name}"
    proc = processes.python(name, [JOB, "--out", str(out), "--root", str(tmp_path / f"shm-{name}"),
                                   "--persist-to", str(durable), *args], env=run_env)
    code = proc.popen.wait(timeout=120)
    assert code == expect_code, processes.dump_logs()
    return (json.loads((out / "result.json").read_text()) if code == 0 else None), proc.log()


def _manifest(durable: Path, run_id: str, step: int) -> Path:
    return durable / run_id / "manifests" / f"step-{step:012d}.json"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_durable_directory_another_user_created_and_trained_into_is_refused(processes, tmp_path, shared_tmp):
    """The other user creates ``persist_to`` first (world-readable) and puts the durable copies of
    a job of its own there under the victim's (predictable) run id. The victim resumed that job's
    weights; now it stops with an error naming the directory, its owner and what to do."""
    theirs = tmp_path / "their-job"  # the other user's job, trained here; its copies then written as theirs
    _job(processes, "theirs", tmp_path, theirs, ["--run-id", "victim-job", "--max-steps", "20"])
    copies = {path.relative_to(theirs): path.read_bytes() for path in theirs.rglob("*") if path.is_file()}
    durable = shared_tmp / "persist"

    def train_into_persist_to() -> None:
        _mkdir(durable, 0o755)()
        for relative, data in copies.items():
            (durable / relative).parent.mkdir(parents=True, exist_ok=True)
            (durable / relative).write_bytes(data)

    as_other_user(train_into_persist_to)
    assert _manifest(durable, "victim-job", 20).stat().st_uid == NOBODY

    _, log = _job(processes, "victim", tmp_path, durable, ["--run-id", "victim-job", "--max-steps", "30"],
                  expect_code=1)
    assert f"durable directory '{durable}' is owned by uid {NOBODY}" in log, log
    assert "another local user could plant or swap durable snapshots there" in log, log
    assert "Remove it (as its owner or root) or choose another persist_to (or LIGHTNING_FT_PERSIST_TO)" in log, log


@pytest.fixture(scope="module")
def durable_of_one_job(tmp_path_factory):
    """A durable directory of this user with one job's copies (run ``job-d``, 20 steps; step 20
    durable, and earlier steps as fast as the uploads ran), made once per module; tests copy it."""
    from proc_utils import ProcessSet

    root = tmp_path_factory.mktemp("durable-job")
    procs = ProcessSet(log_dir=root)
    try:
        result, _ = _job(procs, "first", root, root / "durable", ["--run-id", "job-d", "--max-steps", "20"])
    finally:
        procs.kill_all()
    assert result["end_step"] == 20 and _manifest(root / "durable", "job-d", 20).exists()
    return root / "durable"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_durable_step_of_another_model_is_skipped_with_a_warning_and_the_job_starts_fresh(
        processes, tmp_path, durable_of_one_job):
    """The same run id with another model (the job crashed in the old code: the step was downloaded,
    then found to be of another model after the ranks had agreed on it)."""
    durable = tmp_path / "durable"
    shutil.copytree(durable_of_one_job, durable)
    result, log = _job(processes, "other-model", tmp_path, durable, ["--run-id", "job-d", "--hidden", "48",
                                                                     "--max-steps", "30"])
    assert (result["start_step"], result["trained_steps"]) == (0, 30), log
    assert f"skipped the durable manifest {_manifest(durable, 'job-d', 20)}: it was taken from a different model" \
        in log, log


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_manifest_whose_timeline_leads_outside_persist_to_is_refused_and_nothing_there_is_read(
        processes, tmp_path, durable_of_one_job):
    """A manifest's timeline ``../../../../outside/x`` made the job load a shard from outside
    ``persist_to`` (here a real shard moved there, so that resuming from it would work)."""
    durable = tmp_path / "durable"
    shutil.copytree(durable_of_one_job, durable)
    step_dir = durable / "job-d" / "steps" / f"step-{20:012d}"
    [timeline] = [p for p in step_dir.iterdir() if p.is_dir()]
    outside = tmp_path / "outside" / "x"
    outside.mkdir(parents=True)
    shutil.move(timeline / "rank0.snap", outside / "rank0.snap")
    shutil.rmtree(timeline)
    # only the tampered step is left to resume from (which earlier steps the first job copied
    # depends on how fast its uploads ran: step 15's copy is skipped when step 10's still runs)
    for other in (durable / "job-d" / "manifests").glob("step-*.json"):
        if other != _manifest(durable, "job-d", 20):
            other.unlink()
    manifest = _manifest(durable, "job-d", 20)
    escape = "../../../../outside/x"
    assert (step_dir / escape / "rank0.snap").resolve() == (outside / "rank0.snap").resolve()
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "segment": escape}))
    shard = outside / "rank0.snap"
    os.utime(shard, (1_000_000, shard.stat().st_mtime))  # atime before mtime: a read would move it (relatime)

    result, log = _job(processes, "escape", tmp_path, durable, ["--run-id", "job-d", "--max-steps", "30"])
    assert (result["start_step"], result["trained_steps"]) == (0, 30), log
    assert f"skipped the durable manifest {manifest}: timeline '{escape}' is not a plain name" in log, log
    assert shard.stat().st_atime == 1_000_000, "the shard outside persist_to was read"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_with_a_job_secret_a_manifest_whose_seal_fails_is_skipped_with_a_warning(processes, tmp_path):
    """Copies made under one secret resume under it; under another (another job's manifests, or
    forged ones) they are skipped with a warning and the job starts fresh."""
    durable, copy = tmp_path / "durable", tmp_path / "durable-copy"
    first, _ = _job(processes, "first", tmp_path, durable, ["--run-id", "job-s", "--max-steps", "20"],
                    LIGHTNING_FT_SECRET="secret-one")
    assert first["end_step"] == 20
    shutil.copytree(durable, copy)  # the next job's own copies would replace these manifests

    other, log = _job(processes, "other-secret", tmp_path, copy, ["--run-id", "job-s", "--max-steps", "30"],
                      LIGHTNING_FT_SECRET="secret-two")
    assert (other["start_step"], other["trained_steps"]) == (0, 30), log
    assert (f"skipped the durable manifest {_manifest(copy, 'job-s', 20)}: its seal does not match the job "
            "secret") in log, log

    same, log = _job(processes, "same-secret", tmp_path, durable, ["--run-id", "job-s", "--max-steps", "25"],
                     LIGHTNING_FT_SECRET="secret-one")
    assert (same["start_step"], same["trained_steps"]) == (20, 5), log
    assert not _manifest(durable, "job-s", 20).read_bytes().startswith(b"{")  # sealed, not plain JSON


# ------------------------------------------------------------------------------- manifests and paths, in one process


@pytest.mark.parametrize("path", ["..", "a/../../b", "/etc/passwd", "a//b", "a/./b", "a\\b", "a\0b", "a/"])
def test_a_target_path_that_could_leave_the_target_is_refused(path):
    from lightning_ft.checkpoint.durable.targets import path_parts

    with pytest.raises(ValueError, match="is not a plain name"):
        path_parts(path)
    assert path_parts("job/steps/step-000000000010/0123abcd/rank0.snap")[-1] == "rank0.snap"


def _good_manifest() -> dict:
    return {"step": 10, "segment": "0123456789abcdef", "world_size": 1, "run_id": "job", "model": "m",
            "shards": [{"rank": 0, "nbytes": 100, "checksum": "snapshot-crc32:00000000"}]}


@pytest.mark.parametrize("field, value, why", [
    ("segment", "../../..", "timeline '../../..' is not a plain name"),
    ("segment", "/abs/path", "timeline '/abs/path' is not a plain name"),
    ("segment", "a/b", "is not a plain name"),
    ("segment", "..", "is not a plain name"),
    ("segment", "", "is not a plain name"),
    ("segment", 7, "is not a plain name"),
    ("step", "10", "step '10' is not a whole number"),
    ("step", -1, "is not a whole number"),
    ("step", 10.0, "is not a whole number"),
    ("world_size", True, "is not a whole number"),
    ("model", None, "model None is not text"),
])
def test_every_manifest_field_that_names_a_path_is_parsed_strictly(field, value, why):
    from lightning_ft.checkpoint.durable.records import parse_manifest

    assert parse_manifest(_good_manifest())[1].timeline == "0123456789abcdef"
    with pytest.raises(ValueError, match=why.replace(".", r"\.")):
        parse_manifest({**_good_manifest(), field: value})
    with pytest.raises(ValueError, match="rank '0' is not a whole number"):
        parse_manifest({**_good_manifest(), "shards": [{"rank": "0", "nbytes": 1, "checksum": "snapshot-crc32:0"}]})


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64,), value)}, "global_step": int(value)}


def _published(tmp_path: Path, target, **signer) -> DurableTier:
    """A tier over ``target`` (``signer=``: sealing with it) with step 10 of run ``job`` complete (one rank)."""
    tier = DurableTier(target, "job", **signer)
    store = SnapshotStore(tmp_path / "shm", run_id="job", rank=0)
    assert tier.upload(store.save(_state(10.0), 10), "seg", world_size=1).complete
    return tier


def _rewrite_manifest(tier: DurableTier, **changes) -> None:
    path = tier.manifest_path(10)
    tier.target.write(path, [json.dumps({**json.loads(tier.target.read(path)), **changes}).encode()])


@pytest.mark.parametrize("escape", ["../../../outside", "/outside"])
def test_over_s3_a_manifest_timeline_that_leaves_the_prefix_is_refused(tmp_path, s3_server, caplog, escape):
    import uuid

    options = {"endpoint_url": s3_server["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
    target = open_target(f"s3://lightning-ft-test/escape-{uuid.uuid4().hex[:8]}/persist", options)
    tier = _published(tmp_path, target)
    assert tier.complete_steps() == [10]
    _rewrite_manifest(tier, segment=escape)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.durable"):
        assert tier.complete_steps() == []
    assert f"timeline '{escape}' is not a plain name" in caplog.text
    with pytest.raises(ValueError, match="is not a plain name"):
        target.read(f"job/steps/{escape}/rank0.snap")


def test_manifests_of_another_run_or_model_are_skipped_with_the_reason(tmp_path, caplog):
    tier = _published(tmp_path, LocalDirTarget(str(tmp_path / "durable")))
    model = json.loads(tier.target.read(tier.manifest_path(10)))["model"]
    assert tier.complete_steps(expect=ExpectedIdentity("job", model)) == [10]
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.durable"):
        assert tier.complete_steps(expect=ExpectedIdentity("job", "another-model")) == []
        assert "it was taken from a different model" in caplog.text
        _rewrite_manifest(tier, run_id="another-job")
        assert tier.complete_steps() == []
    assert "it belongs to run 'another-job', not to this run 'job'" in caplog.text


def test_with_a_secret_an_unsealed_altered_or_moved_manifest_is_skipped(tmp_path, caplog):
    from lightning_ft.schema.signing import Signer

    tier = _published(tmp_path, LocalDirTarget(str(tmp_path / "durable")), signer=Signer(b"the job secret"))
    assert tier.complete_steps() == [10]
    path = tier.manifest_path(10)
    good = tier.target.read(path)
    assert DurableTier(tier.target, "job", signer=Signer(b"another secret")).complete_steps() == []
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.durable"):
        tier.target.write(path, [good.replace(b'"world_size": 1', b'"world_size": 2')])
        assert tier.complete_steps() == []
        assert "its seal does not match the job secret" in caplog.text
        tier.target.write(path, [good[20:]])  # the JSON without its seal
        assert tier.complete_steps() == []
        assert "it is not sealed with the job secret" in caplog.text
        tier.target.write(path, [good])
        tier.target.write(tier.manifest_path(11), [good])  # a sealed manifest moved to another step
        assert tier.complete_steps() == [10]
    assert f"{tier.manifest_path(11)}: its seal does not match" in caplog.text


def test_a_durable_directory_that_is_a_symlink_or_writable_by_others_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.symlink(theirs, tmp_path / "link")
    with pytest.raises(ValueError, match=r"durable directory '.*link' is a symbolic link"):
        LocalDirTarget(str(tmp_path / "link"))
    os.chmod(theirs, 0o777)
    with pytest.raises(ValueError, match=r"is writable by its group and other users.*0777.*chmod go-w"):
        LocalDirTarget(str(theirs))
    created = LocalDirTarget(str(tmp_path / "new" / "durable"))
    assert stat.S_IMODE(os.lstat(created.directory).st_mode) == 0o700
