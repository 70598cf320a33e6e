"""Packaging: the sdist carries every C++ source, and the wheel built from it alone (build
isolation on) installs into a fresh venv and builds and loads its kernel there. Both run
tests/check_wheel.sh, which .ci/run also runs in full after `make test`."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "check_wheel.sh"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="the `build` package is not installed"),
    pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"),
]


def run_check(**env):
    return subprocess.run(["bash", str(SCRIPT), sys.executable], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)


def test_sdist_has_every_cpp_source():
    proc = run_check(CHECK_WHEEL_SDIST_ONLY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sdist OK" in proc.stdout


@pytest.mark.slow  # a fresh venv and a build of the kernel (minutes); .ci/run runs tests/check_wheel.sh itself
def test_wheel_from_the_sdist_loads_its_kernel():
    proc = run_check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installed wheel OK" in proc.stdout
