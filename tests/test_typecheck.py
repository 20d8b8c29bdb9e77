"""mypy as a test: it runs beside the process tests, which mostly wait, instead of before the
suite (about 25 s of the README test command's wall time on 2 cores). ``ruff check .`` stays
in the command itself: it takes half a second and fails fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proc_utils import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_finds_no_issues():
    """``mypy`` with the project's configuration (pyproject.toml: the package, strictly)."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=280)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
