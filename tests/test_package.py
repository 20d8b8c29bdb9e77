import subprocess
import sys
from pathlib import Path

import lightning_ft
from lightning_ft import ExitCode


def test_exit_codes_are_distinct_and_nonzero_except_success():
    import signal

    values = [int(code) for code in ExitCode]
    assert len(set(values)) == len(values)
    assert ExitCode.SUCCESS == 0
    # our own codes stay clear of the shell's and the signals'; STOPPED *is* the SIGTERM code on purpose
    assert ExitCode.STOPPED == 128 + signal.SIGTERM
    assert all(v not in (0, 1, 2) and v < 126 for v in values if v not in (0, ExitCode.STOPPED))


def test_the_one_exit_exception_carries_its_code_and_says_why():
    from lightning_ft import FaultTolerantExit
    from lightning_ft.exit_codes import stopped_by

    exit_ = FaultTolerantExit(ExitCode.NO_RESTART, "no spare left")
    assert isinstance(exit_, SystemExit) and exit_.code == 83 and exit_.exit_code is ExitCode.NO_RESTART
    assert str(exit_) == "exit 83 (NO_RESTART): no spare left"
    import signal

    other = FaultTolerantExit(stopped_by(signal.SIGUSR1), "stopped")
    assert other.code == 128 + signal.SIGUSR1 and str(other) == f"exit {128 + signal.SIGUSR1}: stopped"


def test_import_does_not_pull_in_lightning():
    code = "import sys, lightning_ft; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_installed_package_registers_its_strategies_when_lightning_loads():
    """The startup hook (``lightning_ft-startup.pth``): an unchanged script's first ``import
    lightning.pytorch`` registers ``ddp_ft``; Python's start imports neither lightning_ft nor
    torch for it; ``LIGHTNING_FT_AUTOLOAD=0`` turns it off. (A whole ``LightningCLI`` run with
    ``--trainer.strategy=ddp_ft`` and no import of ours: tests/scripts/lightning_user_cli.py.)"""
    import os

    code = ("import sys; started = sorted(m for m in sys.modules if m.startswith(('lightning_ft', 'torch'))); "
            "from lightning.pytorch.strategies import StrategyRegistry; "
            "print(started, 'ddp_ft' in StrategyRegistry, 'fsdp_ft' in StrategyRegistry)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LIGHTNING_FT_AUTOLOAD": "1"})
    assert out.stdout.strip() == "[] True True", (out.stdout, out.stderr[-2000:])
    # turned off: no watcher at all (so Lightning's import, not run here, registers nothing)
    code = "import sys; print([type(f).__name__ for f in sys.meta_path if 'Startup' in type(f).__name__])"
    for autoload, expected in (("1", "['LightningFtStartupWatcher']"), ("0", "[]")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LIGHTNING_FT_AUTOLOAD": autoload})
        assert out.stdout.strip() == expected, (autoload, out.stdout, out.stderr[-2000:])


def test_the_startup_hook_imports_nothing_cannot_be_shadowed_and_off_means_off(tmp_path):
    """Issue 47, item 6: the hook imported its module by name at every start -- one planted in the
    current directory or on PYTHONPATH ran instead, in pip too -- pulled in ~66 modules through
    ``importlib.abc`` (13-78 ms), imported its module with ``LIGHTNING_FT_AUTOLOAD=0`` and ran under
    ``python -I``. Now its line imports nothing until Lightning is imported."""
    import os

    planted = tmp_path / "_lightning_ft_startup.py"
    planted.write_text("import pathlib; pathlib.Path(__file__).with_name('ran').write_text('planted code ran')\n")
    probe = ("import sys; print(sorted(sys.modules) == sorted(BASE), "
             "[type(f).__name__ for f in sys.meta_path if 'Startup' in type(f).__name__])")
    base = subprocess.run([sys.executable, "-c", "import sys; print(sorted(sys.modules))"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "LIGHTNING_FT_AUTOLOAD": "0"}).stdout.strip()
    for env, flags, expected in (({"LIGHTNING_FT_AUTOLOAD": "1", "PYTHONPATH": f":{tmp_path}"}, [],
                                  "True ['LightningFtStartupWatcher']"),
                                 ({"LIGHTNING_FT_AUTOLOAD": "0"}, [], "True []"),
                                 ({}, ["-I"], "True []")):
        out = subprocess.run([sys.executable, *flags, "-c", f"BASE = {base}\n{probe}"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path, env={**os.environ, **env})
        assert out.stdout.strip() == expected, (env, flags, out.stdout, out.stderr[-2000:])
    assert not (tmp_path / "ran").exists()
    # (Lightning's import, which registers the strategies, is the test above)


def test_the_checkpoint_layer_below_its_lightning_pieces_does_not_pull_in_lightning():
    # launchers, agents and the strategy's snapshot service use these without a Trainer
    code = ("import sys, lightning_ft.checkpoint, lightning_ft.checkpoint.service, "
            "lightning_ft.checkpoint.durable.persister, lightning_ft.checkpoint.exchange.agreement; "
            "print('lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_cli_lists_commands():
    out = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "store" in out.stdout and "health" in out.stdout


def test_version():
    assert lightning_ft.__version__


def test_the_fault_matrix_names_only_tests_that_exist():
    """tests/FAULTS.md: every `file`: `test_name` it cites is a test in that file."""
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    text = (tests / "FAULTS.md").read_text()
    cited = re.findall(r"`(\w+)`: `(test_\w+)", text)
    assert len(cited) >= 30
    for module, name in cited:
        source = (tests / f"test_{module}.py").read_text()
        assert f"def {name}" in source or f"def {name.rstrip('_')}" in source, (module, name)


def test_every_benchmark_script_imports():
    # the benchmarks are run by hand; a refactor that breaks their imports would otherwise show
    # only when someone re-measures
    code = """
import importlib.util, pathlib, sys
bench = pathlib.Path("benchmarks")
sys.path.insert(0, str(bench))
for path in sorted(bench.glob("bench_*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    print(path.stem)
"""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == len(list((repo / "benchmarks").glob("bench_*.py")))
