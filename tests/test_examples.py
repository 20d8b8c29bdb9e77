"""The fine-tuning examples: they run, refuse bad arguments cleanly, and resume exactly after SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from proc_utils import REPO_ROOT, child_env, wait_for

EXAMPLES = REPO_ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402  (examples/common.py)

# a few steps on tiny data: the point is that the script works end to end, not the metric
SMOKE_ARGS = {
    "finetune_mlp.py": ["--max-steps", "6", "--pretrain-steps", "5", "--target-rows", "64", "--batch-size", "16"],
    "finetune_transformer.py": ["--max-steps", "6", "--pretrain-steps", "5", "--labelled", "64",
                                "--batch-size", "16"],
}
FINAL = re.compile(r"^FINAL (\S+) step=(\d+) val_accuracy=([\d.]+) val_macro_f1=([\d.]+) weights=(\w+)$", re.M)


def example_env() -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if not k.startswith(("LIGHTNING_FT_", "PL_"))}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_example(script: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=example_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", sorted(SMOKE_ARGS))
def test_example_runs_and_prints_its_final_metric_line(script, tmp_path):
    shm = tmp_path / "shm"
    done = run_example(script, [*SMOKE_ARGS[script], "--snapshot-dir", str(shm), "--run-id", "smoke",
                                "--snapshot-every", "2", "--progress-every", "3"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "starting at step 0 (of 6)" in done.stdout
    assert re.search(r"^step 3/6  loss [\d.]+ train_acc [\d.]+", done.stdout, re.M), done.stdout
    final = FINAL.findall(done.stdout)
    assert len(final) == 1 and final[0][0] == script[:-3] and final[0][1] == "6", done.stdout
    assert 0.0 <= float(final[0][2]) <= 1.0 and 0.0 <= float(final[0][3]) <= 1.0
    assert not list(shm.rglob("*.snap")), "a finished run frees its snapshots"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("script, args, message", [
    ("finetune_mlp.py", ["--max-steps", "0"], "argument --max-steps: expected a positive integer, got '0'"),
    ("finetune_mlp.py", ["--lr", "nan"], "argument --lr: expected a positive number"),
    ("finetune_mlp.py", ["--devices", "2"], "--devices 2 needs --strategy ddp"),
    ("finetune_mlp.py", ["--batch-size", "64", "--target-rows", "32"], "larger than --target-rows"),
    ("finetune_mlp.py", ["--strategy", "ddp_ft"], "LIGHTNING_FT_ENDPOINT"),
    ("finetune_transformer.py", ["--d-model", "30", "--heads", "4"], "must be a multiple of --heads"),
    ("finetune_transformer.py", ["--strategy", "horovod"], "argument --strategy: invalid choice"),
    ("finetune_transformer.py", ["--run-id", " "], "--run-id must not be empty"),
    ("demo.py", ["--max-steps", "50", "--kill-at-step", "50"], "must be below --max-steps"),
    ("demo.py", ["--timeout", "-3"], "argument --timeout: expected a positive number"),
])
def test_bad_arguments_exit_2_with_a_clear_message(script, args, message, monkeypatch, capsys):
    for key in [k for k in os.environ if k.startswith("LIGHTNING_FT_")]:
        monkeypatch.delenv(key)
    module = __import__(script[:-3])
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_pretrained_file_gives_the_same_model_and_random_state_as_pretraining_here(tmp_path):
    """``--pretrained PATH``: the first process pretrains and writes PATH, the next loads it; either
    way the module and the random state after it (the head's initialization) are the same."""
    import torch

    finetune_mlp = __import__("finetune_mlp")
    calls = []

    def pretrain():
        calls.append(1)
        return finetune_mlp.pretrain_body(8, 3, seed=1)

    def run(path):
        torch.manual_seed(5)
        body = common.pretrained_module(path, pretrain, lambda: finetune_mlp.make_body(8))
        return [p.detach().clone() for p in body.parameters()], torch.rand(3)

    path = str(tmp_path / "body.pt")
    here, written, loaded = run(None), run(path), run(path)
    assert len(calls) == 2 and os.path.exists(path) and not os.path.exists(path + ".tmp")
    for other in (written, loaded):
        assert all(torch.equal(a, b) for a, b in zip(here[0], other[0], strict=True))
        assert torch.equal(here[1], other[1])


def test_argument_error_from_the_command_line_has_no_traceback():
    done = run_example("finetune_transformer.py", ["--seq-len", "1"], timeout=60)
    assert done.returncode == 2
    assert "--seq-len must be at least 2" in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------- exact resume

@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stop_after", [3, 8])  # mid-epoch, and exactly at the end of an epoch
def test_loader_state_resumes_the_same_order_even_with_a_wrong_epoch_from_outside(world_size, stop_after):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = torch.utils.data.TensorDataset(torch.arange(64))

    def loader(rank: int = 0):
        sampler = common.resumable_sampler(dataset, world_size, rank, seed=7)
        return StatefulDataLoader(dataset, batch_size=8 // world_size, sampler=sampler, drop_last=True)

    def batches(dl, n):
        out = []
        while len(out) < n:
            out += [b[0].tolist() for b in dl][: n - len(out)]
        return out

    for rank in range(world_size):
        full = batches(loader(rank), 24)  # 3 epochs of 8 batches
        first = loader(rank)
        it = iter(first)
        head = [next(it)[0].tolist() for _ in range(stop_after)]
        state = first.state_dict()
        resumed = loader(rank)
        resumed.load_state_dict(state)
        tail = []
        for epoch in range(4):
            resumed.sampler.set_epoch(100 + epoch)  # ignored: the sampler counts its own epochs
            tail += [b[0].tolist() for b in resumed]
            if len(head) + len(tail) >= 24:
                break
        assert head + tail[: 24 - len(head)] == full
    assert len({tuple(b) for b in full}) == 24  # every epoch is shuffled differently


@pytest.mark.multiprocess
@pytest.mark.timeout(240)  # three fresh interpreters: 93 s seen beside the suite
def test_sigterm_stops_with_81_and_the_rerun_resumes_to_the_same_weights(tmp_path):
    """SIGTERM -> GracefulTermination snapshots at an agreed step, exit 81 -> the same command resumes
    from that step and ends bit-identical to an uninterrupted run (weights digest of the FINAL line)."""
    args = ["finetune_mlp.py", "--max-steps", "40", "--pretrain-steps", "5", "--target-rows", "128",
            "--batch-size", "16", "--snapshot-every", "5"]  # 8 batches per epoch: the rest crosses epochs
    reference = run_example(args[0], [*args[1:], "--snapshot-dir", str(tmp_path / "ref"), "--run-id", "ref",
                                      "--progress-every", "0"])
    assert reference.returncode == 0, reference.stderr
    (ref_final,) = FINAL.findall(reference.stdout)

    resumable = [*args[1:], "--snapshot-dir", str(tmp_path / "shm"), "--run-id", "resume"]
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen([sys.executable, str(EXAMPLES / args[0]), *resumable, "--progress-every", "1",
                                  "--step-delay", "0.05"], stdout=log, stderr=subprocess.STDOUT,
                                 env=example_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        assert wait_for(lambda: "step 12/40" in log_path.read_text(), timeout=90), log_path.read_text()
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 81, log_path.read_text()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    text = log_path.read_text()
    stop_step = int(re.search(r"emergency snapshot of step (\d+) committed", text).group(1))
    assert 12 <= stop_step < 40 and "FINAL" not in text

    second = run_example(args[0], [*resumable, "--progress-every", "0"])
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from the snapshot of step {stop_step} (of 40)" in second.stdout
    (final,) = FINAL.findall(second.stdout)
    assert final == ref_final, f"resumed run differs from the uninterrupted one:\n{final}\n{ref_final}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_mlp_example_with_fsdp_ft_trains_sharded_in_two_participants(processes, tmp_path):
    """``--strategy fsdp_ft``: two participants (one binds the store), every layer sharded; rank 0
    prints the final line, evaluated and digested on the gathered weights."""
    from proc_utils import free_port

    env = {**example_env(), "LIGHTNING_FT_ENDPOINT": f"127.0.0.1:{free_port()}", "LIGHTNING_FT_RUN_ID": "fsdp-example",
           "LIGHTNING_FT_NNODES": "2", "OMP_NUM_THREADS": "1"}
    args = [str(EXAMPLES / "finetune_mlp.py"), *SMOKE_ARGS["finetune_mlp.py"], "--strategy", "fsdp_ft",
            "--snapshot-every", "2"]
    for name in ("a", "b"):
        processes.python(name, [*args, "--snapshot-dir", str(tmp_path / f"shm-{name}")],
                         env={**env, "LIGHTNING_FT_DOMAIN_ID": f"host-{name}"})
    codes = processes.wait_all(timeout=120)
    assert codes == {"a": 0, "b": 0}, processes.dump_logs()
    finals = [FINAL.findall(processes.procs[name].log()) for name in ("a", "b")]
    assert sorted(len(f) for f in finals) == [0, 1], processes.dump_logs()
    assert next(f for f in finals if f)[0][1] == "6"
