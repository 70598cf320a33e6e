"""The report's C fast path (csrc/logscan.c) as a user meets it: built on first use into the cache,
loaded from there after, built again where the cached one is damaged, and where it cannot be had
(no C compiler, or asked not to), the same diff read by the Python twins. (What it computes, line
by line and pair by pair against those twins: tests/test_diff_align.py.)"""

import os
import shutil
import subprocess
import sys

import pytest

from overflow_fast.recording.recorder import encode_line, meta_record
from overflow_fast.report import logscan

STATUS = "from overflow_fast.report import logscan; print(logscan.status())"


def _run(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith("OVERFLOW_FAST_") and k not in ("TORCH_EXTENSIONS_DIR", "CC")}
    environment.update(OVERFLOW_FAST_CACHE_DIR=str(tmp_path / "cache"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    environment.update(env)
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def _compiler_here():
    return shutil.which(logscan.compiler()) is not None


def test_built_once_then_loaded_from_the_cache(tmp_path):
    if not _compiler_here():
        pytest.skip("no C compiler here: the Python twins read (tested below)")
    out, err = _run(tmp_path, "-c", STATUS)
    assert out.startswith(f"C ({tmp_path / 'cache'}") and "building the C fast path of overflow-fast diff" in err, err
    again, err = _run(tmp_path, "-c", STATUS)
    assert again == out and "building" not in err


def test_a_damaged_build_is_built_again_never_loaded(tmp_path):
    if not _compiler_here():
        pytest.skip("no C compiler here")
    out, _ = _run(tmp_path, "-c", STATUS)
    library = out[len("C ("):-len(")\n")]
    with open(library, "r+b") as f:
        f.truncate(4096)  # loaded, a cut library is SIGBUS, not an error
    again, err = _run(tmp_path, "-c", STATUS)
    assert again == out and "not loading the cached C fast path of overflow-fast diff" in err, err


def _logs(tmp_path):
    paths = []
    for name, scale in (("a", 1.0), ("b", 1.5)):
        path = tmp_path / f"{name}.jsonl"
        with open(path, "wb") as f:
            f.write(encode_line(meta_record(None, None)))
            for step in range(4):
                for module in ("embed", "h.0", "head"):
                    value = 2.0 * (scale if step >= 2 and module == "h.0" else 1.0)
                    f.write(encode_line(dict(record="entry", step=step, phase="forward", call=0, module=module,
                                             **{"class": "Linear"}, entry="output", dtype="float32", numel=10,
                                             abs_min=0.5, abs_max=value, nan=0, posinf=0, neginf=0, zero_frac=0.0,
                                             subnormal_frac=0.0, rank=None)))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("without", [{"CC": "/nonexistent/cc"}, {"OVERFLOW_FAST_WITHOUT_EXTENSION": "1"}],
                         ids=["no C compiler", "asked not to"])
def test_without_it_the_python_twins_give_the_same_diff(tmp_path, without):
    a, b = _logs(tmp_path)
    status, _ = _run(tmp_path, "-c", STATUS, **without)
    assert status.startswith("Python (")
    if "CC" in without:
        assert "no C compiler" in status and "/nonexistent/cc" in status
    python_diff, _ = _run(tmp_path, "-m", "overflow_fast", "diff", a, b, **without)
    assert "first parting: step 2, forward, module h.0 (Linear), entry output" in python_diff
    if _compiler_here():
        c_diff, _ = _run(tmp_path / "other", "-m", "overflow_fast", "diff", a, b)
        assert c_diff == python_diff


def test_a_prebuilt_one_is_loaded_where_nothing_may_be_built(tmp_path):
    """As setup.py builds it ahead of time (OVERFLOW_FAST_AOT): found in the package's prebuilt
    folder by a process that may not build (OVERFLOW_FAST_JIT=0) and has an empty cache."""
    if not _compiler_here():
        pytest.skip("no C compiler here")
    library = logscan.build_prebuilt(tmp_path / "prebuilt")
    out, err = _run(tmp_path, "-c", "import sys; from overflow_fast import build_cache; "
                    "from pathlib import Path; build_cache.PREBUILT = Path(sys.argv[1]); " + STATUS,
                    str(tmp_path / "prebuilt"), OVERFLOW_FAST_JIT="0")
    assert out == f"C ({library})\n" and "building" not in err
    status, _ = _run(tmp_path, "-c", STATUS, OVERFLOW_FAST_JIT="0")  # no prebuilt one: nothing built
    assert status.startswith("Python (") and "OVERFLOW_FAST_JIT=0 forbids building one" in status
    assert not list((tmp_path / "cache").glob("logscan-*"))
