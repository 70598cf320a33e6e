"""The tested range (`make test-versions`): the tests that depend on torch's and transformers'
behaviour, run on each combination of Python, torch and transformers that docs/install.md lists,
each in a virtual environment of its own, made once and reused.

    python3 tests/versions_matrix.py [--only TEXT] [--list] [--jobs N]

Environments live in $OVERFLOW_FAST_VERSIONS_DIR (default ~/.cache/overflow_fast-versions), one per
Python and torch (``py3.11-torch2.13.0``); the transformers version is installed into it before
each run. torch's wheels other than the CPU builds pull its CUDA libraries: a few GB per
environment, downloaded once. Each environment runs this checkout (PYTHONPATH), not an installed
copy, and builds the C++ kernel for its torch on first use (a minute or more, then cached).

The output ends with one line per combination it ran (Python, torch, transformers, pytest's
summary) and the exit status is 0 only when every one passed. Stdlib only: it runs under any
Python 3.8+.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (Python, torch, the transformers versions run with it): the floor (torch 2.7, the oldest tested,
# which passes all but its compile tests), the lent GPU machine's torch on Python 3.12, the pinned
# CI torch, and the newest torch the project's registry serves; transformers' last 4.x and a
# recent 5.x.
MATRIX = (
    ("3.11", "2.7.1", ("4.57.6",)),
    ("3.12", "2.11.0", ("4.57.6", "5.18.0")),
    ("3.11", "2.13.0", ("5.25.0",)),
    ("3.11", "2.14.1", ("4.57.6", "5.18.0")),
)
# what the tests need beside torch and transformers (numpy: torch warns at import without it;
# accelerate: transformers' Trainer needs it)
TOOLS = ("numpy", "pytest", "pytest-xdist", "hypothesis", "ninja", "accelerate")
# the tests whose outcome depends on torch's or transformers' version: the drop-in's text against
# the installed reference, the detector and watch(), torch.compile, find_op's replay (also in
# training: dropout's random state, checkpointing, compiled models), torch's GradScaler, the
# hooks' behaviour when a pass is interrupted or runs under no_grad, collectives (gloo), and the
# engine on this torch (the torch backend; the C++ kernel built against this torch's headers)
TESTS = ("tests/test_compat_rules.py", "tests/test_compat_transformers.py", "tests/test_compat_random.py",
         "tests/test_detector.py", "tests/test_watch.py", "tests/test_compile.py", "tests/test_find_op.py",
         "tests/test_find_op_training.py", "tests/test_grad_scaler.py", "tests/test_interrupted_passes.py",
         "tests/test_evaluation_memory.py", "tests/test_distributed_collectives.py",
         "tests/test_stats_torch.py", "tests/test_tensor_kinds.py", "tests/test_cpu_backend.py")
# the kernel tests' quick half, as `make test-fast` runs it
KERNEL_FILTER = ("not test_cpu_backend or ((random_bit or special_values or every_byte or empty_and_zero "
                 "or non_contiguous) and not default-)")


def versions_dir():
    return Path(os.environ.get("OVERFLOW_FAST_VERSIONS_DIR") or "~/.cache/overflow_fast-versions").expanduser()


def find_python(version):
    """An interpreter for ``version`` ("3.11") that runs: pyenv's newest X.Y.*, else pythonX.Y on
    PATH (a pyenv shim there fails for a version that is not selected)."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", "python")),
                        key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parent.parent.name)])
    candidates = candidates[::-1] + [p for p in [shutil.which(f"python{version}")] if p]
    for candidate in candidates:
        out = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == version:
            return candidate
    return None


def run(command, **kwargs):
    print("+ " + " ".join(str(c) for c in command), flush=True)
    return subprocess.run([str(c) for c in command], **kwargs)


def environment(python_version, torch_version):
    """The environment for this Python and torch, made (or completed) if needed; its python, or
    None with the reason printed."""
    folder = versions_dir() / f"py{python_version}-torch{torch_version}"
    python = folder / "bin" / "python"
    wanted = " ".join((f"torch=={torch_version}",) + TOOLS)
    marker = folder / ".overflow_fast-versions"
    if marker.is_file() and marker.read_text() == wanted and python.is_file():
        return python
    interpreter = find_python(python_version)
    if interpreter is None:
        print(f"no Python {python_version} here (pythonX.Y on PATH, or pyenv)", flush=True)
        return None
    if not python.is_file() and run([interpreter, "-m", "venv", folder]).returncode != 0:
        return None
    if run([python, "-m", "pip", "install", "--quiet", *wanted.split()]).returncode != 0:
        return None
    marker.write_text(wanted)
    return python


def installed(python, name):
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def summary_line(output):
    """pytest's closing line ("12 passed, 1 skipped in 3.2s"), without its '=' frame."""
    for line in reversed(output.splitlines()):
        if re.search(r"\b(passed|failed|error|errors|no tests ran)\b", line):
            return line.strip("= ").strip()
    return "no summary"


def run_tests(python, jobs, log):
    """pytest on TESTS with this checkout on the path, its whole output in ``log``; (passed, summary)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERFLOW_FAST_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("VIRTUAL_ENV", None)
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(jobs), *TESTS, "-k", KERNEL_FILTER]
    proc = run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout)
    tail = proc.stdout.splitlines()[-40:] if proc.returncode != 0 else proc.stdout.splitlines()[-2:]
    print("\n".join(tail) + f"\n(the whole output: {log})", flush=True)
    return proc.returncode == 0, summary_line(proc.stdout)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None,
                        help="only the combinations whose name (py3.11-torch2.13.0-transformers5.18.0) holds this")
    parser.add_argument("--list", action="store_true", help="print the combinations and exit")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2")),
                        help="pytest-xdist workers (default: $MAX_JOBS, else 2)")
    args = parser.parse_args(argv)
    combinations = [(py, torch, tf) for py, torch, tfs in MATRIX for tf in tfs
                    if args.only is None or args.only in f"py{py}-torch{torch}-transformers{tf}"]
    if args.list or not combinations:
        for py, torch, tf in combinations:
            print(f"py{py}-torch{torch}-transformers{tf}")
        return 0 if combinations else 2
    print(f"environments in {versions_dir()}", flush=True)
    results = []
    for py, torch, tf in combinations:
        name = f"Python {py}, torch {torch}, transformers {tf}"
        print(f"\n== {name}", flush=True)
        start = time.monotonic()
        python = environment(py, torch)
        if python is None:
            results.append((name, False, "environment could not be made", 0.0))
            continue
        if installed(python, "transformers") != tf and \
                run([python, "-m", "pip", "install", "--quiet", f"transformers=={tf}"]).returncode != 0:
            results.append((name, False, f"transformers {tf} could not be installed", 0.0))
            continue
        ok, summary = run_tests(python, args.jobs, versions_dir() / "logs" / f"py{py}-torch{torch}-transformers{tf}.log")
        versions = subprocess.run([str(python), "-c", "import platform, torch, transformers; print("
                                   "platform.python_version(), torch.__version__, transformers.__version__)"],
                                  capture_output=True, text=True).stdout.split()
        if versions:
            name = f"Python {versions[0]}, torch {versions[1]}, transformers {versions[2]}"
        results.append((name, ok, summary, time.monotonic() - start))
    print("\n== the tested range (tests/versions_matrix.py)")
    width = max(len(name) for name, *_ in results)
    for name, ok, summary, seconds in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<{width}}  {summary}  ({seconds:.0f} s)")
    return 0 if all(ok for _, ok, *_ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
