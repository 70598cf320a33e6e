"""Whether the list kernel may be launched directly on a GPU: a verdict found once, in a child
process, per GPU model, CUDA driver, Triton and kernel build, and cached.

The direct launch (cuLaunchKernel from C++ on the kernel Triton compiled) packs the kernel's
arguments itself. Were that packing ever wrong for some GPU, driver or Triton, the launch would
touch memory it must not, and an illegal address ends the CUDA context of the process that made
it: a training job's. So a process never makes its first direct launch itself. At the first use of
a CUDA device (its self-check passed, every launch so far Triton's own), this module looks for
the verdict of that device's kind:

- passed: the device launches directly from then on;
- failed: every launch stays Triton's, and ``overflow-fast info`` says why;
- none yet: a probe starts in the background, and the process launches through Triton meanwhile.
  The probe is a child process (``python -m overflow_fast.stats.triton_probe``): it sets the
  device up with direct launches allowed, runs the self-check (each variant through Triton's
  launch, then directly) and reads of 1 to 17 tensors on torch's stream and a side stream against
  the torch backend. Its verdict is cached and, if it passed, this process's launchers of that
  device launch directly from then on.

What the probe costs: one child process, once per machine and kind (every later process reads
the cache): a Python with torch, Triton and this package imported, a CUDA context on the device
(a few hundred MB of its memory, for the probe's life), and Triton's compiles of the self-check's
variants (Triton's on-disk cache then holds them for this process too). About 20 to 40 s of one
CPU core (PROBE_SECONDS: measured under the interpreter on a 2-core CPU, projected for a GPU), in
the background. Several processes of one job (a rank per GPU) run one probe: one takes the lock,
the others read its verdict.

The key of a verdict is what could change its answer: the GPU's name and compute capability, the
CUDA driver's version, Triton's, torch's, the C++ extension's bytes and the kernel's source. A
verdict is read only from a file under the cache of compiled modules that passes its rules
(build_cache: folders and file nobody but this user or root can write); a probe that ran out of
time, or could not start, leaves no verdict (the next process tries again).
"""

import atexit
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

from .. import build_cache
from . import cpu_backend, triton_launch
from .kinds import tensor_device
from .triton_common import triton

PROBE_TIMEOUT = 600.0  # seconds a background probe may take (compiles on a busy machine)
PROBE_SECONDS = "20-40 s"  # what one takes: see the module's docstring
FOLDER = "launch-verdicts"  # under the cache of compiled modules
PASSED, FAILED, NOT_MEASURED = "passed", "failed", "not measured"
_SOURCES = ("triton_kernels.py", "triton_launch.py")  # the kernel, and what the direct launch passes it

_probes = {}  # key name -> its _Probe in this process
_children = set()  # probe processes running, ended with this process
_lock = threading.Lock()


def verdict_key(device):
    """What the verdict of ``device`` depends on, as a dict (its name is a hash of it)."""
    device = tensor_device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} (sm_{props.major}{props.minor})"
    else:
        gpu = device.type
    return {"gpu": gpu, "driver": _driver_version() if device.type == "cuda" else None,
            "triton": getattr(triton, "__version__", None), "torch": torch.__version__, "build": _build_hash()}


def key_name(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


_BUILD = []


def _build_hash():
    """sha256 of the C++ extension's file and of the kernel's sources (computed once)."""
    if not _BUILD:
        digest = hashlib.sha256()
        path = cpu_backend.details().get("path")
        for file in ([Path(path)] if path else []) + [Path(__file__).with_name(name) for name in _SOURCES]:
            try:
                digest.update(file.read_bytes())
            except OSError:
                digest.update(f"unreadable {file}".encode())
        _BUILD.append(digest.hexdigest()[:24])
    return _BUILD[0]


def _driver_version():
    """The CUDA driver's version (cuDriverGetVersion), or None where it cannot be asked."""
    import ctypes

    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def folder():
    """(the private folder of the verdicts, made if missing; or None, why not)."""
    root, rejected = build_cache.cache_folder()
    if root is None:
        return None, f"no private cache folder ({rejected})"
    path, problem = build_cache.private_folder(root / FOLDER, create=True)
    return (None, problem) if problem is not None else (path, None)


def cached(key):
    """(the verdict recorded for ``key``, or None; why none can be read, or None)."""
    where, problem = folder()
    if where is None:
        return None, problem
    content, problem = build_cache.read_trusted(where / f"{key_name(key)}.json")
    if content is None:
        return None, problem
    try:
        verdict = json.loads(content)
    except ValueError:
        return None, f"{where / key_name(key)}.json is not a verdict"
    if verdict.get("key") != key or verdict.get("outcome") not in (PASSED, FAILED):
        return None, f"{where / key_name(key)}.json is not this key's verdict"
    return verdict, None


def record(key, verdict):
    """Keep a passed or failed verdict for ``key``; False where it cannot be written."""
    where, _ = folder()
    if where is None or verdict.get("outcome") not in (PASSED, FAILED):
        return False
    try:
        build_cache.write_atomic(where / f"{key_name(key)}.json", json.dumps({**verdict, "key": key}))
    except OSError:
        return False
    return True


def probe_command(device):
    """The probe's child process: this package's ``triton_probe`` on ``device``."""
    return [sys.executable, "-m", "overflow_fast.stats.triton_probe", str(tensor_device(device))]


def _child_environment():
    """This process's environment, with this package first on the child's path (it may not be
    installed: a checkout on sys.path)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("OVERFLOW_FAST_DIRECT_LAUNCH", None)  # the probe is where the direct launch is tried
    return env


def run_probe(device, timeout, command=None, keep=True):
    """Run the probe of ``device`` in a child process for at most ``timeout`` seconds and return
    its verdict: {"outcome": passed / failed / not measured, "detail", "seconds", "result" (the
    child's report, or None), "output" (its last lines), "recorded"}. A passed or failed verdict
    is kept for the device's key (``keep``); a probe that ran out of time, could not start, or made
    no direct launch (nothing to judge) is "not measured" and leaves none."""
    key = verdict_key(device)
    command = command or probe_command(device)
    started = time.perf_counter()
    try:
        process = subprocess.Popen(command, env=_child_environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except OSError as error:
        return _verdict(NOT_MEASURED, f"the probe could not start ({error})", started, None, "")
    _children.add(process)
    try:
        output, _ = process.communicate(timeout=max(timeout, 0.1))
        ended = None
    except subprocess.TimeoutExpired:
        _kill(process)
        output, _ = process.communicate()
        ended = f"ran past its {timeout:.0f} s and was killed"
    except BaseException:  # an interrupt: the child goes with it
        _kill(process)
        process.wait()
        raise
    finally:
        _children.discard(process)
    lines = output.splitlines()
    tail = "\n".join(lines[-12:])
    result = next((json.loads(line[len("PROBE "):]) for line in reversed(lines) if line.startswith("PROBE ")), None)
    launched = "DIRECT" in lines  # the child had started its direct launches
    last = next((line.strip() for line in reversed(lines) if line.strip() and not line.startswith("PROBE ")), "")
    if ended is None and process.returncode:
        code = process.returncode
        ended = (f"died of {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                 else f"ended with exit status {code}")
    if ended is not None and "ran past" in ended:
        verdict = _verdict(NOT_MEASURED, f"the probe {ended}", started, result, tail)
    elif result is not None and result.get("passed"):
        if result.get("direct_launches"):
            verdict = _verdict(PASSED, f"{result['direct_launches']} direct launches exact", started, result, tail)
        else:
            verdict = _verdict(NOT_MEASURED, f"nothing launched directly ({result.get('launch')})", started, result, tail)
    else:
        why = (result or {}).get("error") or f"the probe {ended or 'gave no result'}"
        if result is None and last and last != "DIRECT":
            why += f" ({last[:200]})"
        if launched or (result or {}).get("stage") == "direct":
            verdict = _verdict(FAILED, why, started, result, tail)
        else:  # it never reached a direct launch: nothing is known of it
            verdict = _verdict(NOT_MEASURED, f"before any direct launch: {why}", started, result, tail)
    verdict["recorded"] = keep and record(key, verdict)
    return verdict


def _verdict(outcome, detail, started, result, output):
    return {"outcome": outcome, "detail": detail, "seconds": round(time.perf_counter() - started, 1),
            "result": result, "output": output, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def _kill(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: whatever it started goes too
    except OSError:
        process.kill()


@atexit.register
def _end_children():
    for process in list(_children):
        _kill(process)


# -- a device's first use --------------------------------------------------------------------------

def first_use(state, start=True):
    """Decide the direct launch of ``state``'s device (its self-check passed): from a cached
    verdict at once, else by a probe started in the background (``start``; ``overflow-fast info``
    starts none). Only a launcher whose driver launches directly waits for a verdict."""
    launcher = state.launcher
    if launcher is None or launcher.driver not in triton_launch.VERDICT_DRIVERS:
        return
    key = verdict_key(state.device)
    verdict, problem = cached(key)
    if verdict is not None:
        apply(state, verdict)
        return
    if not start:
        state.probe = (f"waits for its probe (none has run for this GPU, driver, Triton and build; a read's first use "
                       f"starts one: a child process, about {PROBE_SECONDS})")
        return
    state.probe = (f"waits for its probe (a child process started at this device's first use, about {PROBE_SECONDS}; "
                   "until it passes every launch is Triton's)")
    owner = weakref.ref(state)
    name = key_name(key)
    with _lock:
        probe = _probes.get(name)
        if probe is None or (probe.verdict is not None and probe.verdict.get("outcome") == NOT_MEASURED):
            probe = _probes[name] = _Probe(state.device, key)
        if probe.verdict is None:
            probe.waiters.append(owner)
            return
    apply(state, probe.verdict)


class _Probe:
    """The probe of one key in this process, in a thread of its own, and the states waiting for it."""

    def __init__(self, device, key):
        self.key = key
        self.waiters = []
        self.verdict = None
        self.thread = threading.Thread(target=self._run, args=(device,), name=f"overflow_fast probe {device}",
                                       daemon=True)
        self.thread.start()

    def _run(self, device):
        """The probe (one process at a time per key: the others wait, then read its verdict),
        applied to every state waiting for it."""
        try:
            where, _ = folder()
            lock = build_cache.FileLock(where / f"{key_name(self.key)}.lock") if where is not None else None
            with lock if lock is not None else contextlib.nullcontext():
                verdict, _ = cached(self.key)
                if verdict is None:
                    verdict = run_probe(device, PROBE_TIMEOUT)
        except Exception as error:  # noqa: BLE001 - the process launches through Triton, as without a verdict
            verdict = {"outcome": NOT_MEASURED, "detail": f"the probe could not run ({type(error).__name__}: {error})"}
        with _lock:
            self.verdict = verdict
            waiters, self.waiters = self.waiters, []
        for owner in waiters:
            state = owner()
            if state is not None:
                apply(state, verdict)


def apply(state, verdict):
    """Make ``verdict`` ``state``'s: its launchers launch directly from now on if it passed."""
    outcome = verdict.get("outcome")
    if outcome == PASSED:
        state.probe = f"passed its probe ({verdict.get('detail')}, {verdict.get('when', 'now')})"
        for launcher in state.launchers():
            launcher.allow_direct()
    elif outcome == FAILED:
        state.probe = f"failed its probe ({verdict.get('detail')}, {verdict.get('when', 'now')}): every launch is Triton's"
    else:
        state.probe = f"was not judged ({verdict.get('detail')}): every launch is Triton's; the next process probes again"


def wait(timeout=None):
    """Wait for the probes running in the background (tests)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for probe in list(_probes.values()):
        probe.thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))


def describe():
    """One line for ``overflow-fast info``: when the probe runs, what it costs, where verdicts are."""
    where, problem = folder()
    kept = f"verdicts in {where}" if where is not None else f"verdicts not kept ({problem})"
    return (f"the list kernel's direct launch is first tried in a child process, once per GPU model, CUDA driver, "
            f"Triton and kernel build, at the first use of such a device (about {PROBE_SECONDS} of one CPU core and "
            f"a CUDA context, in the background; launches go through Triton until it passes); {kept}")
