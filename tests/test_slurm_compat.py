"""``Trainer(strategy="ddp_ft")`` inside srun tasks of any layout (lightning_ft/_lightning/slurm.py).

The environments are those srun gives a task (captured from a real ``sbatch`` on SLURM 22.05,
shortened to what Lightning reads). Lightning's auto-detected ``SLURMEnvironment`` rejects
``--ntasks`` without ``--ntasks-per-node`` in ``Trainer.__init__``; ddp_ft must not care.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

import lightning_ft  # noqa: F401  (registers ddp_ft)
from lightning_ft._lightning.slurm import skips_cluster_detection
from lightning_ft.strategy import FaultTolerantDDPStrategy, StrategyConfigError

# what srun sets for task 1 of `#SBATCH --ntasks=3` on one node
NTASKS_3 = {
    "SLURM_JOB_ID": "7", "SLURM_JOBID": "7", "SLURM_JOB_NAME": "ddp-ft", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "3",
    "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "3", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
}
LAYOUTS = {
    "--ntasks=3": NTASKS_3,
    "--nodes=1 --ntasks-per-node=3": {**NTASKS_3, "SLURM_NTASKS_PER_NODE": "3"},
    "--nodes=2 --ntasks-per-node=2 (task 3)": {
        **NTASKS_3, "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NODELIST": "node[1-2]", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"},
    # a heterogeneous job: 2 active tasks in component 0, a spare of another kind in component 1 (written
    # after srun's documented *_HET_GROUP_n variables, not captured: a het job needs two nodes)
    "hetjob -n2 + -n1 (task 2)": {
        **NTASKS_3, "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "7",
        "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "1", "SLURM_TASKS_PER_NODE": "2,1"},
}


@pytest.fixture
def srun_task(monkeypatch, port):
    def enter(variables: dict[str, str]) -> None:
        for name in list(os.environ):
            if name.startswith(("SLURM_", "LIGHTNING_FT_", "TORCHELASTIC_")) or name in ("MASTER_ADDR", "MASTER_PORT"):
                monkeypatch.delenv(name)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("LIGHTNING_FT_ENDPOINT", f"127.0.0.1:{port}")
        monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "slurm-7")
        monkeypatch.setenv("LIGHTNING_FT_NNODES", "2:3")
    return enter


def trainer(strategy="ddp_ft", **kwargs):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=kwargs.pop("devices", 1), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ddp_ft_by_name_works_in_every_srun_layout(srun_task, layout):
    srun_task(LAYOUTS[layout])
    built = trainer()
    assert isinstance(built.strategy, FaultTolerantDDPStrategy)
    environment = built.strategy.cluster_environment
    assert type(environment).__name__ == "RoundEnvironment"  # the strategy's own, not the placeholder
    assert built._accelerator_connector.cluster_environment is environment


def test_other_strategies_still_get_lightnings_slurm_detection(srun_task):
    # the same environment makes Lightning itself fail: the failure ddp_ft no longer inherits
    srun_task(NTASKS_3)
    with pytest.raises(RuntimeError, match="You set `--ntasks=3`"):
        trainer("ddp")
    srun_task(LAYOUTS["--nodes=1 --ntasks-per-node=3"])
    assert isinstance(trainer("ddp").strategy.cluster_environment, SLURMEnvironment)


def test_a_layout_ddp_ft_cannot_use_fails_with_our_message(srun_task):
    srun_task(LAYOUTS["--nodes=1 --ntasks-per-node=3"])
    with pytest.raises(StrategyConfigError, match="each process is one participant, and srun already starts 3"):
        trainer(devices=2)


def test_skips_detection_only_for_names_of_our_strategies():
    class Subclass(FaultTolerantDDPStrategy):
        pass

    def factory(**kwargs):
        return FaultTolerantDDPStrategy(**kwargs)

    registry = {"ddp_ft": {"strategy": FaultTolerantDDPStrategy}, "mine": {"strategy": Subclass},
                "by_factory": {"strategy": factory}, "other_factory": {"strategy": lambda: None},
                "ddp": {"strategy": pl.strategies.DDPStrategy}, "broken": {}}
    ours = (FaultTolerantDDPStrategy, factory)
    assert skips_cluster_detection("ddp_ft", None, registry, ours)
    assert skips_cluster_detection("mine", None, registry, ours)
    assert skips_cluster_detection("by_factory", None, registry, ours)
    assert not skips_cluster_detection("other_factory", None, registry, ours)
    assert not skips_cluster_detection("ddp", None, registry, ours)
    assert not skips_cluster_detection("broken", None, registry, ours)
    assert not skips_cluster_detection("unknown", None, registry, ours)
    assert not skips_cluster_detection("ddp_ft", LightningEnvironment(), registry, ours)  # a plugin is used as given
    assert not skips_cluster_detection(object(), None, registry, ours)  # an instance brings its environment


SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "ddp_ft.sbatch"


def task_loop() -> str:
    """The per-task restart loop srun runs in examples/slurm/ddp_ft.sbatch (its ``bash -c`` text)."""
    text = SBATCH.read_text()
    return text.split("srun --kill-on-bad-exit=0 --wait=0 bash -c '", 1)[1].split("' ddp_ft-task", 1)[0]


@contextlib.contextmanager
def task_loop_running(tmp_path: Path, participant: str) -> Iterator[subprocess.Popen[str]]:
    """The task loop around ``participant`` (a bash script; ``$RUNS``: a file it may append to),
    its whole session killed at the end."""
    env = {**os.environ, **NTASKS_3, "SLURMD_NODENAME": "localhost", "FT_RESTART_DELAY": "0",
           "RUNS": str(tmp_path / "runs")}
    loop = subprocess.Popen(["bash", "-c", task_loop(), "ddp_ft-task", "bash", "-c", participant], env=env,
                            start_new_session=True, text=True)
    try:
        yield loop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)
        loop.wait(10)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_task_loop_restarts_a_crashed_participant_as_a_rejoining_spare(tmp_path):
    # crashes (SIGKILL: 137) twice, then finishes: run 3 is the restarted participant's second start
    participant = 'echo "${LIGHTNING_FT_REJOIN:-0}" >> "$RUNS"; [ $(wc -l < "$RUNS") -ge 3 ] || kill -9 $$'
    with task_loop_running(tmp_path, participant) as loop:
        assert loop.wait(30) == 0
    assert (tmp_path / "runs").read_text().split() == ["0", "1", "1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_after_a_stop_signal_the_task_loop_never_restarts_its_participant(tmp_path):
    # the participant outlives the stop (KillWait ran out: SIGKILL, 137): a crash's code, but the
    # task was told to stop, so it ends with that code and starts nothing
    participant = 'echo run >> "$RUNS"; trap "" TERM; sleep 2; kill -9 $$'
    with task_loop_running(tmp_path, participant) as loop:
        assert wait_for_file(tmp_path / "runs", 20)
        os.kill(loop.pid, signal.SIGTERM)
        assert loop.wait(30) == 137
    assert (tmp_path / "runs").read_text().split() == ["run"]


def wait_for_file(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()
