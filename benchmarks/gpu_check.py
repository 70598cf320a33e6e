"""One command for an NVIDIA machine: is the Triton backend exact there, and what does it cost?

It measures the kernels and the detector's cost in training, and always returns what it measured.

    python3 benchmarks/gpu_check.py              # from the repository root, no install step; --budget 330 s
    python3 benchmarks/gpu_check.py --phases compiled-host-bound --skip direct-launch   # a second run
    python3 benchmarks/gpu_check.py --dry-run    # no GPU: every phase on CPU tensors, TRITON_INTERPRET=1; 1200 s

A run takes one compiled regime (a cold inductor compile each, which one run's budget cannot hold
twice), the most valuable first; the others are left to the next runs, and a run says so at its
start with the command. Whatever a run did not measure (left out, skipped for the budget, stopped
by a time box or the watchdog, not reached) is named in ``gpu_check.md`` with the exact command of
the next run, from the first row on; that command skips the direct launch's probe once it passed
(its verdict is kept: later processes launch directly without one).

It puts this checkout (and its tests/ folder, for the float64 oracle) first on ``sys.path``: nothing
is installed. The C++ kernel builds on first use, inside the budget.

What comes back, whatever happens: ``gpu_check.md`` (the summary table, rewritten after every row),
``gpu_check.csv`` (the same rows) and ``gpu_check.log`` (everything printed) in ``--out`` (default
``$OUT``, the lent machine's folder of results). Every phase is guarded: an error becomes a
``failed: <error>`` row and the next phase runs. An exactness mismatch or a failed self-check is a
row too, and the measuring goes on (a device whose self-check failed reads with the table kernels).
Phases write their rows as they go (exactness a row per group of formats, a step phase a row per
variant as soon as it has a median), and check their deadline inside: the time box's signal is the
last resort. At the end a table says how long each phase took, its time box, and what the same
phase's compiles may take on a GPU (projected from bench_triton_compile's figures).

The budget's clock starts at this file's first line, before the imports and the C++ build. Each
phase gets a time box, a share of what is left (a signal stops a phase that overruns it; the
direct launch's probe gets at least 60 s, the self-check at least 20 s, where the budget allows);
a watchdog thread writes the table and ends the process when the budget is spent, whatever hangs
(and faulthandler kills it 3 s later if the hang holds the interpreter). The default budget, 330 s,
leaves room for a second run within 15 minutes of device time. The dry run's, 1200 s, holds no
device time: on a 2-core CPU a cold C++ build alone takes 100 s, and the interpreter's kernels are
slow.

Exit status: 0 every phase ran (or was skipped for the budget) and every check passed; 1 an
exactness mismatch, a failed self-check or a direct launch that failed its probe; 2 nothing to
measure (no CUDA device without ``--dry-run``, no torch); 3 a phase failed; 4 the watchdog (or a
SIGTERM) stopped the run. The first that applies in the order 1, 2, 4, 3.

Phases, in order (``--phases`` picks some, ``--skip`` drops some):
- ``direct-launch`` (first on a GPU whatever ``--phases`` says, unless skipped or
  OVERFLOW_FAST_DIRECT_LAUNCH=0 is set): the library's probe of the list kernel's direct launch
  (cuLaunchKernel on Triton's compiled kernel, from C++; stats/triton_probe), in a child process
  bounded by the time box, since a wrong argument layout can kill the CUDA context and every
  phase after with it: the self-check with direct launches, then reads of 1 to 17 tensors on
  torch's stream and a side stream, against the torch backend. Its verdict is kept (the phases
  after it, and later processes, launch directly once it passed). A child that dies in its direct
  launches, or is wrong, fails it (its error output is the row; the rest of the run has
  OVERFLOW_FAST_DIRECT_LAUNCH=0). A probe that runs out of time, or dies before its first direct
  launch, is "not measured": the rest of the run launches through Triton and the next run probes
  again.
- ``exactness``: the triton backend bit for bit against the torch backend, the CPU backend (host
  copies) and the float64 oracle (tests/oracle.py, the small tensors), in groups of at most four
  formats (a row each): random bit patterns, special values, tails, views made on the device
  (unaligned starts, offsets into a larger storage, strided, transposed and permuted), empty,
  0-dim, a mixed batch of the group; then a batch of every format, and one tensor over 2**31
  elements; the list kernel against the table kernels on the same tensors.
- ``self-check``: the list kernel's self-check, at first use and again with its kernels compiled,
  its time and its launches (direct, ordinary), the launch path and the probe's verdict.
- ``bandwidth``: ``dst.copy_(src)`` on 1 GiB, then the list kernel, the torch backend and the
  reference's per-tensor ops (``triton.testing.do_bench`` medians) at 4K..1G elements, fp32 and
  bf16, and the table kernels on 300 mixed tensors of 256..270K elements.
- ``step-gpu-bound``, ``step-host-bound``, ``step-large``: training steps (AdamW, bf16, random
  weights from a transformers config, nothing downloaded), each variant on its own copy of the
  model, medians of round-robin steps after warm-up, ``torch.cuda.synchronize()`` around each:
  no detector, the reference (transformers' DebugUnderflowOverflow), ``check="batch"`` and
  ``watch()`` (its gradient reads in backward included). GPU-bound: GPT-2 small, batch 8 x 1024;
  host-bound: GPT-2 small, batch 1 x 512; large: 4 Llama-style layers, hidden 4096, batch 2 x 1024.
- ``host-per-hook``: GPT-2 small's hook sequence (bf16, 8 x 1024, no grad) recorded on the meta
  device and replayed on zero-filled device tensors with bench_host_path.py's machinery, synced
  after each forward, through the real path (each hook's one C++ call, the launcher with the CUDA
  driver): (replay time - replay time without hooks) / hooks, launches per forward (direct,
  ordinary, table kernels), and each device's launch path and self-check as ``overflow-fast info``
  names them. Where the launches were direct, the same again with OVERFLOW_FAST_DIRECT_LAUNCH=0
  (Triton's own launch) if the time box allows: host us per hook, direct against ordinary.
- ``compiled-gpu-bound``, ``compiled-host-bound``, ``compiled-large``: the same steps under
  ``torch.compile`` (inductor) with ``check="batch"``, and without the detector when the budget
  allows, timed against the eager step without one; the compile is in the warm-up. One a run.
- ``sweep``: GB/s of a few (BLOCK_SIZE, NUM_WARPS) at 256M elements, each passed to the launch.
- ``e2e`` (only when asked): ``benchmarks/bench_end_to_end.py --device cuda --quick``.

``--dry-run`` runs the same code on CPU tensors: the kernels through Triton's interpreter (the
probe's child too: no direct launch there), the host-per-hook phase with the driver call stubbed
(bench_host_path's count driver), tiny models (1-2 layers, a few tokens), every row marked
"dry-run" (not GPU figures). Its device is named ``cpu:0``, a form its tensors never report (as
``cuda`` is on a GPU): the engine's per-device tables must take it as theirs.
"""

import time

STARTED = time.perf_counter()  # the budget's clock

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import csv  # noqa: E402
import faulthandler  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (HERE, os.path.join(ROOT, "tests"), ROOT):  # this checkout's package first
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)

import _shared  # noqa: E402 - the benchmarks' shared builders (the standard library only at import)

PHASES = (  # name, share of the budget, what it needs besides torch
    ("direct-launch", 0.15, ("triton",)),  # its Triton compiles are cached for the phases after it
    ("exactness", 0.12, ("triton",)),
    ("self-check", 0.03, ("triton",)),
    ("bandwidth", 0.08, ("triton",)),
    ("step-gpu-bound", 0.07, ("transformers",)),
    ("step-host-bound", 0.05, ("transformers",)),
    ("step-large", 0.08, ("transformers",)),
    ("host-per-hook", 0.07, ("transformers",)),
    ("compiled-gpu-bound", 0.25, ("transformers",)),
    ("compiled-host-bound", 0.15, ("transformers",)),
    ("compiled-large", 0.20, ("transformers",)),
    ("sweep", 0.05, ("triton",)),
    ("e2e", 0.10, ("transformers",)),
)
PHASE_NAMES = tuple(name for name, _, _ in PHASES)
OPT_IN = ("e2e",)
# a cold inductor compile each: one a run (one run's budget cannot hold two), the most valuable first
COMPILED = ("compiled-gpu-bound", "compiled-host-bound", "compiled-large")
PROBE = "direct-launch"  # runs first wherever the direct launch may run (module docstring)
DIRECT_LAUNCH = "OVERFLOW_FAST_DIRECT_LAUNCH"
COMMAND = "python3 benchmarks/gpu_check.py"
DEFAULT_BUDGET = 330.0
DRY_RUN_BUDGET = 1200.0
RESERVE = 2.0  # seconds kept after the last phase's time box, for the table
MIN_PHASE = 2.0  # a phase that would get less is skipped
# the least time box of a phase whose work cannot stop at a deadline of its own, where the budget
# allows (at most half of what is left): the probe's child (its imports and compiles, about 20 s
# on a 2-core CPU) and the self-check (a library call)
FLOORS = {"direct-launch": 60.0, "self-check": 20.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU needed: tiny sizes on CPU tensors through TRITON_INTERPRET=1")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run, imports and C++ build included (default {DEFAULT_BUDGET:.0f}; "
                             f"dry run {DRY_RUN_BUDGET:.0f})")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="folder for gpu_check.md, .csv and .log (default $OUT; none: print only)")
    parser.add_argument("--phases", default=None,
                        help="comma-separated phases to run (default all but " + ", ".join(OPT_IN) + "; one compiled "
                             "regime a run)")
    parser.add_argument("--skip", default="", help="comma-separated phases not to run")
    parser.add_argument("--e2e", action="store_true", help="add the e2e phase")
    parser.add_argument("--max-numel", type=float, default=2**30, help="largest tensor timed in bandwidth")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed round-robin training steps per variant (default 6; dry run 2)")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = DRY_RUN_BUDGET if args.dry_run else DEFAULT_BUDGET
    names = list(PHASE_NAMES)
    if args.phases:
        chosen = [p for p in args.phases.split(",") if p]
        if not args.dry_run and PROBE not in chosen:
            chosen.append(PROBE)  # before anything launches on the device (it sorts first)
    else:
        chosen = [n for n in names if n not in OPT_IN]
    if args.e2e and "e2e" not in chosen:
        chosen.append("e2e")
    skipped = [p for p in args.skip.split(",") if p]
    unknown = sorted(set(chosen + skipped) - set(names))
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(unknown)}; the phases: {', '.join(names)}")
    compiled = [n for n in COMPILED if n in chosen and n not in skipped]
    args.selected = [n for n in names if n in chosen and n not in skipped and (n not in COMPILED or n == compiled[0])]
    args.left_out = compiled[1:]
    return args


# --------------------------------------------------------------------------- what comes back

class Tee(io.TextIOBase):
    """A stream that writes to the console and to the log, flushing both at once (a killed run
    keeps everything printed before)."""

    def __init__(self, console, log):
        self.console, self.log = console, log

    def write(self, text):
        for stream in (self.console, self.log):
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass
        return len(text)

    def flush(self):
        for stream in (self.console, self.log):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

    def fileno(self):
        return self.console.fileno()

    @property
    def encoding(self):
        return getattr(self.console, "encoding", "utf-8")

    def isatty(self):
        return False


class Report:
    """The rows measured so far, written to the out folder after each one."""

    def __init__(self, out, budget_s, dry_run):
        self.out = out
        self.budget_s = budget_s
        self.rows = []
        self.source = "dry-run (CPU, not GPU figures)" if dry_run else "(device not known yet)"
        self.dry_run = dry_run
        self.checks_failed = []
        self.phases_failed = []
        self.nothing_to_measure = None
        self.stopped = None  # the watchdog's line
        self.notes = []  # blocks printed after the table (the kernel table, the sweep)
        self.planned = []  # this run's phases
        self.left_out = []  # phases left to a second run from the start
        self.finished = set()  # phases that ran to their end (or failed for a reason a rerun keeps)
        # the probe's outcome: None (not run), "passed", "not taken" (nothing to launch directly
        # here), "failed", "not measured" (out of time, or dead before a direct launch), "skipped"
        self.probe = None
        self.phase_times = []  # (phase, seconds it took, its time box, its first compiles)
        self.ended = False  # the run has ended (a table written before says it may still be running, or killed)
        self.lock = threading.RLock()

    def add(self, measure, value, detail=""):
        self.set(measure, value, detail, replace=False)

    def set(self, measure, value, detail="", replace=True):
        """A row, written at once; ``replace``: in the place of the row of the same measure (a
        median that more steps refine)."""
        clean = lambda text: " ".join(str(text).replace("|", "/").split())  # noqa: E731 - one table cell
        row = (clean(measure), clean(value), clean(detail))
        with self.lock:
            index = next((i for i, known in enumerate(self.rows) if known[0] == row[0]), None) if replace else None
            if index is None:
                self.rows.append(row)
            else:
                self.rows[index] = row
            print(f"  -> | {row[0]} | {row[1]} | {row[2]} |", flush=True)
            self.write()

    def status(self):
        if self.checks_failed:
            return 1
        if self.nothing_to_measure:
            return 2
        if self.stopped:
            return 4
        return 3 if self.phases_failed else 0

    def headline(self):
        elapsed = time.perf_counter() - STARTED
        state = f"exit status {self.status()}" if self.ended else "running (or killed: no end was written)"
        parts = [state, f"{elapsed:.0f} s of a {self.budget_s:.0f} s budget"]
        if self.checks_failed:
            parts.append("checks failed: " + ", ".join(self.checks_failed))
        if self.phases_failed:
            parts.append("phases failed: " + ", ".join(self.phases_failed))
        if self.stopped:
            parts.append(self.stopped)
        return "gpu_check: " + "; ".join(parts)

    def second_run(self):
        """The command of the next run, for what this one has not measured (yet): the phases left
        out, skipped for the budget, stopped by their time box or the watchdog, or not reached,
        with one compiled regime (the next); the probe again where it was not measured, skipped
        once it passed, the direct launch off where it failed. None when nothing is left."""
        rest = [name for name in PHASE_NAMES if name != PROBE and (
            name in self.left_out or (name in self.planned and name not in self.finished))]
        rest = [name for name in rest if name not in COMPILED or name == next(n for n in rest if n in COMPILED)]
        if not rest:
            return None
        if self.probe in ("not measured", "skipped"):
            rest.insert(0, PROBE)
        prefix = f"{DIRECT_LAUNCH}=0 " if self.probe == "failed" else ""
        skip = " --skip direct-launch" if self.probe in ("passed", "not taken") and not self.dry_run else ""
        return f"{prefix}{COMMAND} --phases {','.join(rest)}{skip}" + (" --dry-run" if self.dry_run else "")

    def timing(self):
        """The phases' times: here, their time boxes, and what their compiles may take on a GPU."""
        if not self.phase_times:
            return None
        lines = [f"{'phase':>20} {'took':>7} {'box':>6}  on a GPU (--budget {DEFAULT_BUDGET:.0f})"]
        for phase, took, box, compiles in self.phase_times:
            shown = "-" if phase == "startup" else f"{box:.0f}s"
            lines.append(f"{phase:>20} {took:>6.1f}s {shown:>6}  {gpu_projection(phase, compiles)}")
        return "\n".join(lines)

    def table(self):
        lines = ["| measure | value | detail | run |", "|---|---|---|---|"]
        lines += [f"| {m} | {v} | {d} | {self.source} |" for m, v, d in self.rows]
        return "\n".join(lines)

    def blocks(self):
        """The notes, then the phases' times."""
        timing = self.timing()
        return self.notes + ([("phase times (here; on a GPU: projected)", timing)] if timing else [])

    def markdown(self):
        text = self.headline() + "\n\n"
        if self.second_run():
            text += f"Not measured (yet), for a second run: `{self.second_run()}`\n\n"
        text += self.table() + "\n"
        for title, block in self.blocks():
            text += f"\n{title}:\n\n" + "".join(f"    {line}\n" for line in block.splitlines())
        return text

    def write(self):
        if not self.out:
            return
        with self.lock:
            for name, content in (("gpu_check.md", self.markdown()), ("gpu_check.csv", self._csv())):
                path = os.path.join(self.out, name)
                try:
                    with open(path + ".tmp", "w") as f:
                        f.write(content)
                    os.replace(path + ".tmp", path)  # never a half-written table
                except OSError as error:
                    sys.__stderr__.write(f"gpu_check: cannot write {path}: {error}\n")

    def _csv(self):
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["measure", "value", "detail", "run"])
        writer.writerows([(m, v, d, self.source) for m, v, d in self.rows])
        return buffer.getvalue()

    def finish(self):
        with self.lock:
            self.ended = True
            self.write()
            print()
            for title, block in self.blocks():
                print(f"{title}:\n{block}\n")
            print(self.headline())
            if self.second_run():
                print(f"not measured, for a second run: {self.second_run()}")
            print()
            print(self.table(), flush=True)


class TimeBoxSpent(BaseException):
    """Raised in the main thread when a phase overruns its time box (a BaseException, so that no
    ``except Exception`` on the way swallows it)."""


@contextlib.contextmanager
def time_box(seconds, phase):
    def expire(signum, frame):
        raise TimeBoxSpent(f"{phase} ran past its time box of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.05))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Watchdog:
    """Ends the process when the budget is spent (or at SIGTERM), with the table written and the
    phase that was running named, whatever the main thread is doing."""

    def __init__(self, report, budget_s, log):
        self.report = report
        self.deadline = STARTED + budget_s
        self.phase = "startup"
        self.main = threading.main_thread().ident
        self.done = threading.Event()
        # the last resort, from C: a hang that holds the interpreter never lets the thread run
        faulthandler.dump_traceback_later(max(self.deadline + 3.0 - time.perf_counter(), 1.0), exit=True,
                                          file=log or sys.__stderr__)
        self.previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: self.stop_run("SIGTERM"))
        threading.Thread(target=self._watch, name="gpu_check watchdog", daemon=True).start()

    def _watch(self):
        if not self.done.wait(max(self.deadline - time.perf_counter(), 0.0)):
            self.stop_run(f"the watchdog at {self.deadline - STARTED:.0f} s (the budget was spent)")

    def stop_run(self, why):
        """Write the table with a row for the phase that was running, and end the process (and the
        child processes it started)."""
        for child in CHILDREN:  # processes, or modules that own theirs
            with contextlib.suppress(Exception):
                child.kill() if hasattr(child, "kill") else child._end_children()
        frame = sys._current_frames().get(self.main)
        where = "".join(traceback.format_stack(frame)[-2:]).strip().replace("\n", " ") if frame else "?"
        acquired = self.report.lock.acquire(timeout=2.0)
        try:
            self.report.stopped = f"{why} stopped the run during {self.phase}"
            self.report.add(self.phase, f"failed: stopped by {why}", f"the main thread was at {where[:400]}")
            self.report.finish()
        finally:
            if acquired:
                self.report.lock.release()
        sys.stdout.flush()
        os._exit(self.report.status())

    def stop(self):
        """The run ended by itself: no watchdog any more."""
        self.done.set()
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGTERM, self.previous_term)


# --------------------------------------------------------------------------- what a phase compiles

# Seconds of one compile of a variant for sm_90, by kernel and its formats, (aligned, with the
# unaligned loops): benchmarks/bench_triton_compile.py on a 2-core AMD EPYC (AVX-512), Triton 3.6,
# a shared machine's quieter run. On the lent machine's CPU these are projections.
COMPILE_S = {
    "list": {1: (1.0, 0.6), 2: (0.8, 1.1), 4: (1.4, 2.5)},
    "partials": {1: (0.5, 0.5), 2: (0.6, 1.0), 4: (1.1, 1.8)},
}
COMBINE_S = 0.5  # the combine kernel: one variant, one loop
PROBE_CHILD_S = (6.0, 13.4)  # the probe's child: its imports (measured here), its 10 variants (priced as above)
STARTUP_S = ("imports about 10 s; a cold C++ build about 60 s (6 units in parallel; 78-137 s measured on a 2-core "
             "AMD EPYC, loaded)")


def compile_seconds(key):
    """The projected compile of one variant (``FirstLaunches``' key)."""
    kernel, formats, unaligned = key[:3]
    if kernel == "combine":
        return COMBINE_S
    table = COMPILE_S[kernel]
    count = next((n for n in sorted(table) if n >= formats), max(table))
    seconds = table[count][1 if unaligned else 0]
    return seconds * max(formats / count, 1.0)


class FirstLaunches:
    """The variants of the kernels each phase launches first in this run: on a GPU each one is a
    compile (unless Triton's cache holds it from an earlier run), which ``gpu_projection`` prices.
    Counted where the engine launches them (its Python launch paths), passed through."""

    def __init__(self):
        self.seen = set()
        self.new = []

    def install(self):
        from overflow_fast.stats import triton_common, triton_launch, triton_list, triton_table

        def note(key):
            if key not in self.seen:
                self.seen.add(key)
                self.new.append(key)

        def ordinary(real):
            def launch(state, launcher, grid, args, slots, formats, any_unaligned, *shape):
                note(("list", bin(formats).count("1"), any_unaligned, slots, formats, *shape))
                return real(state, launcher, grid, args, slots, formats, any_unaligned, *shape)
            return launch

        def python_read(real):
            def launch(programs, args, slots, formats, any_unaligned, *shape):
                note(("list", bin(formats).count("1"), any_unaligned, slots, formats, *shape))
                return real(programs, args, slots, formats, any_unaligned, *shape)
            return launch

        def table(real):
            def launch(buffer, out, num_tensors, num_chunks, formats, unaligned, *shape, **kwargs):
                if num_chunks:
                    for group, any_unaligned in triton_common.format_groups(formats, unaligned):
                        note(("partials", bin(group).count("1"), any_unaligned, group, (num_tensors - 1).bit_length(),
                              *shape, *kwargs.values()))
                note(("combine", 0, False))
                return real(buffer, out, num_tensors, num_chunks, formats, unaligned, *shape, **kwargs)
            return launch

        triton_launch._ordinary_launch = ordinary(triton_launch._ordinary_launch)
        triton_list._launch_read = python_read(triton_list._launch_read)
        triton_table._launch = table(triton_table._launch)

    def take(self):
        new, self.new = self.new, []
        return new


def gpu_boxes(selected, startup_s=20.0, budget=DEFAULT_BUDGET):
    """{phase: its time box} in a GPU run of ``selected`` whose startup took ``startup_s``, each
    phase taking its whole box (what main() gives them)."""
    left = budget - RESERVE - startup_s
    boxes = {}
    for i, name in enumerate(selected):
        boxes[name] = phase_box(name, selected[i:], left)
        left -= boxes[name]
    return boxes


def gpu_projection(phase, compiles, boxes=None):
    """What ``phase`` may take on a GPU: its box at the default budget, and its compiles priced."""
    if boxes is None:
        selected = parse_args([]).selected if PHASE_NAMES else []
        boxes = gpu_boxes(selected)
    box = boxes.get(phase)
    where = f"box {box:.0f} s; " if box is not None else "(a later run's phase); "
    if phase == "startup":
        return STARTUP_S
    if phase == PROBE:
        return where + (f"the child: imports about {PROBE_CHILD_S[0]:.0f} s and its 10 compiles about "
                        f"{PROBE_CHILD_S[1]:.0f} s (projected), then its reads")
    seconds = sum(compile_seconds(key) for key in compiles)
    return where + f"{len(compiles)} first compiles, about {seconds:.0f} s (projected), then its measuring"


# --------------------------------------------------------------------------- the run's state

CHILDREN = []  # child processes, ended with the run

torch = None  # imported by startup(), inside the budget
triton_be = triton_devices = triton_list = triton_table = torch_be = cpu_be = StatsBatch = None
random_bits = reference_stats = same_stats = special_values = None


class Context:
    def __init__(self, args, report):
        self.args = args
        self.report = report
        self.tiny = args.dry_run
        self.device = None
        self.missing = {}  # what a phase may need -> why it is missing (None: there)
        self.regimes = {}  # regime -> what its step phase built, for its compiled phase
        self.copy_gbps = None
        self.kernel_rows = []
        self.direct = None  # the direct-launch phase's outcome: "passed", "not taken", "failed", "not measured", "off"
        self.first_launches = FirstLaunches()


def startup(ctx):
    """Import torch, the package (which builds or loads the C++ kernel), Triton and transformers,
    each timed; pick the device. False when nothing can be measured."""
    global triton_devices, triton_list, triton_table
    global torch, triton_be, torch_be, cpu_be, StatsBatch, random_bits, reference_stats, same_stats, special_values
    report, args = ctx.report, ctx.args
    if args.dry_run:
        # the interpreter is chosen when the kernels are decorated, i.e. when the backend is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    timings = []
    started = time.perf_counter()
    try:
        import torch as _torch
    except Exception as error:  # noqa: BLE001
        report.nothing_to_measure = f"no torch ({type(error).__name__}: {error})"
        report.add("startup", f"failed: {report.nothing_to_measure}", "")
        return False
    torch = _torch
    timings.append(f"torch {time.perf_counter() - started:.1f} s")

    started = time.perf_counter()
    from overflow_fast.stats import cpu_backend as _cpu_be  # builds or loads the C++ kernel

    cpu_be = _cpu_be
    cpu_be.unavailable_reason()
    timings.append(f"overflow_fast and its C++ kernel {time.perf_counter() - started:.1f} s")

    started = time.perf_counter()
    from overflow_fast.stats import StatsBatch as _StatsBatch
    from overflow_fast.stats import torch_backend as _torch_be
    from overflow_fast.stats import triton_backend as _triton_be
    from overflow_fast.stats import triton_devices as _triton_devices
    from overflow_fast.stats import triton_list as _triton_list
    from overflow_fast.stats import triton_table as _triton_table

    StatsBatch, torch_be, triton_be = _StatsBatch, _torch_be, _triton_be
    triton_devices, triton_list, triton_table = _triton_devices, _triton_list, _triton_table
    ctx.missing["triton"] = triton_be.unavailable_reason()
    ctx.first_launches.install()
    timings.append(f"the triton backend {time.perf_counter() - started:.1f} s")

    import oracle

    random_bits, reference_stats = oracle.random_bits, oracle.reference_stats
    same_stats, special_values = oracle.same_stats, oracle.special_values

    if any("transformers" in needs for name, _, needs in PHASES if name in args.selected):
        started = time.perf_counter()
        try:
            import transformers  # noqa: F401
            ctx.missing["transformers"] = None
        except Exception as error:  # noqa: BLE001 - any failure to import is a missing package here
            ctx.missing["transformers"] = f"{type(error).__name__}: {error}"
        timings.append(f"transformers {time.perf_counter() - started:.1f} s")

    if args.dry_run or torch.cuda.is_available():
        ctx.device = torch_device(args)
        if ctx.device.type == "cuda":
            report.source = torch.cuda.get_device_name(ctx.device)
    else:
        report.nothing_to_measure = "no CUDA device (run with --dry-run to exercise this script without one)"
    report.add("startup", f"{time.perf_counter() - STARTED:.1f} s", "; ".join(timings) + "; " + environment(ctx))
    if report.nothing_to_measure:
        report.add("device", f"failed: {report.nothing_to_measure}", "")
        return False
    return True


def torch_device(args):
    """The run's device: the current CUDA device, with its index (the form its tensors report);
    the dry run's CPU as "cpu:0", a form its tensors never report (they say "cpu"), as "cuda" is on
    a GPU: what the engine keeps per device must take it as theirs all the same."""
    import torch as _torch

    if args.dry_run:
        return _torch.device("cpu", 0)
    return _torch.device("cuda", _torch.cuda.current_device())


def environment(ctx):
    """Versions, the device, the CPU, the C++ kernel and the launch path, in one line."""
    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("triton", "numpy", "transformers"):
        module = sys.modules.get(name)
        parts.append(f"{name} {getattr(module, '__version__', '?')}" if module is not None else f"{name} missing")
    if ctx.device is not None and ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        parts.append(f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                     f"CUDA {torch.version.cuda})")
    parts.append(f"CPU {cpu_model()} x {os.cpu_count()}")
    reason = cpu_be.unavailable_reason()
    parts.append("C++ kernel loaded" if reason is None else f"no C++ kernel ({reason})")
    if ctx.missing.get("triton"):
        parts.append(f"no triton backend ({ctx.missing['triton']})")
    else:
        parts.append(f"list kernel launch {triton_be.launch_path()}")  # overflow-fast info's, before any device
    if ctx.missing.get("transformers"):
        parts.append(f"no transformers ({ctx.missing['transformers']})")
    commit = git_commit()
    if commit:
        parts.append(f"commit {commit}")
    return ", ".join(parts)


def cpu_model():
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def git_commit():
    try:
        result = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device):
    import gc

    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the direct launch, first in a child

def probe_command(args):
    """The probe's child process (None: the library's own, stats/triton_probe); tests stand in for it."""
    return None


def direct_launch(ctx, deadline):
    """The list kernel's direct launch (cuLaunchKernel on Triton's compiled kernel, from C++) tried
    first by the library's probe in a child process, bounded by the time box: a wrong argument
    layout there can kill the CUDA context, and with it every phase after. Until the probe has
    passed, and for the rest of the run when it has not, OVERFLOW_FAST_DIRECT_LAUNCH=0 keeps every
    launch Triton's (and no probe of the library's own starts during the measuring)."""
    from overflow_fast.stats import triton_verdicts

    report = ctx.report
    if os.environ.get(DIRECT_LAUNCH, "1") == "0":
        ctx.direct = report.probe = "off"
        report.add("direct launch", f"not tried: {DIRECT_LAUNCH}=0", "every launch of the list kernel in this run is Triton's")
        return
    previous = os.environ.get(DIRECT_LAUNCH)
    os.environ[DIRECT_LAUNCH] = "0"  # off until the child passed: a time box or the watchdog meanwhile leaves it off
    device = ctx.device if ctx.device is not None else torch_device(ctx.args)
    timeout = max(deadline - time.perf_counter(), 1.0)
    print(f"  the probe: the self-check and reads through the direct launch, in a child process ({timeout:.0f} s at "
          "most)", flush=True)
    CHILDREN.append(triton_verdicts)  # the watchdog ends its children too
    try:
        verdict = triton_verdicts.run_probe(device, timeout, command=probe_command(ctx.args),
                                            keep=device.type == "cuda")
    finally:
        CHILDREN.remove(triton_verdicts)
    print(verdict["output"], flush=True)
    result = verdict["result"] or {}
    tail = " ".join(verdict["output"].strip().splitlines()[-12:])[-700:]
    outcome = verdict["outcome"]
    if outcome == "passed" or (outcome == "not measured" and result.get("passed")):  # passed, or nothing to launch directly
        if previous is None:
            del os.environ[DIRECT_LAUNCH]
        else:
            os.environ[DIRECT_LAUNCH] = previous
        direct = result.get("direct_launches", 0)
        ctx.direct = report.probe = "passed" if outcome == "passed" else "not taken"
        value = f"passed: {direct} direct launches in a child process" if direct else f"not taken: {result.get('launch')}"
        kept = ("; its verdict kept for later processes" if verdict.get("recorded") else
                "; no verdict kept" + ("" if device.type == "cuda" else " (not a GPU)"))
        report.add("direct launch", value,
                   f"self-check {result.get('self_check')} in {result.get('check_ms', 0):.0f} ms (first use: its kernels "
                   f"compiled), then {result.get('reads')} reads exact (1 to 17 tensors, 1 to 3 launches each, views "
                   f"made on the device{', on two streams' if device.type == 'cuda' else ''}); launch "
                   f"{result.get('launch')}; {direct} direct and {result.get('ordinary_launches')} ordinary launches; "
                   f"{verdict['seconds']:.0f} s with the child's start{kept}")
        return
    if outcome == "not measured":
        ctx.direct = report.probe = "not measured"
        report.add("direct launch", f"not measured: {verdict['detail']}",
                   f"{DIRECT_LAUNCH}=0 for the rest of the run; the next run probes again; launch "
                   f"{result.get('launch', '?')}; the child's last output: {tail or '(none)'}")
        return
    ctx.direct = report.probe = "failed"
    report.checks_failed.append(PROBE)
    report.add("direct launch", f"failed: {verdict['detail']}",
               f"{DIRECT_LAUNCH}=0 for the rest of the run; launch {result.get('launch', '?')}; "
               f"the child's last output: {tail or '(none)'}")


# --------------------------------------------------------------------------- exactness

class Mismatch(AssertionError):
    pass


def check_dtypes():
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
    # AMD's fp8 formats, where this torch has them
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
    wide_unsigned = [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
    return dtypes, wide_unsigned


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


def _cpu_backend_dicts(tensors):
    """The CPU backend's statistics of host copies of the tensors it supports: {index: dict}."""
    if cpu_be.unavailable_reason() is not None:
        return {}
    index = [i for i, t in enumerate(tensors) if t.dtype in cpu_be.SUPPORTED_DTYPES]
    host = [tensors[i].cpu() for i in index]
    return dict(zip(index, _dicts(cpu_be.compute(host), host))) if host else {}


def check_batch(tensors, label, counts, oracle_dtypes, oracle_max=5000):
    """Triton's table kernels equal its list kernel (in calls of as many tensors as it takes), the
    torch backend, the CPU backend, and the oracle on the small tensors."""
    table_rows = triton_be.compute(tensors)
    got = _dicts(table_rows, tensors)
    want = _dicts(torch_be.compute(tensors), tensors)
    most = triton_be.MAX_SLOTS * triton_be.MAX_READ_LAUNCHES
    read_rows = torch.cat([_read_rows(tensors[begin:begin + most]) for begin in range(0, len(tensors), most)])
    if not torch.equal(read_rows, table_rows):
        bad = next(i for i in range(len(tensors)) if not torch.equal(read_rows[i], table_rows[i]))
        raise Mismatch(f"{label}[{bad}] {tensors[bad].dtype} {tuple(tensors[bad].shape)}: list kernel "
                       f"{read_rows[bad].tolist()} != table kernels {table_rows[bad].tolist()}")
    on_cpu = _cpu_backend_dicts(tensors)
    counts["cpu"] += len(on_cpu)
    for i, (g, w, t) in enumerate(zip(got, want, tensors)):
        if not same_stats(g, w):
            raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != torch backend {w}")
        if i in on_cpu and not same_stats(g, on_cpu[i]):
            raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != cpu backend {on_cpu[i]}")
        if t.numel() <= oracle_max and t.dtype in oracle_dtypes:
            r = reference_stats(t.cpu())
            if not same_stats(g, r):
                raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != oracle {r}")
    return len(tensors)


def _read_rows(tensors):
    """The list kernel's rows (whatever the device's self-check said)."""
    rows = torch.full((len(tensors), 8), -1, dtype=torch.int64, device=tensors[0].device)
    state = triton_devices.lookup(rows.device) or triton_be.check_device(rows.device)
    if triton_list._read(tensors, rows, state) is False:
        raise Mismatch(f"the list kernel did not take {len(tensors)} tensors")
    return rows


def _readable(dtype, device):
    """Whether the Triton backend takes ``dtype`` and the torch backend (the reference here) can
    read it on ``device``."""
    probe = torch.zeros(2, dtype=dtype, device=device)
    if not triton_be.supports(probe):
        return False
    try:
        torch_be.compute([probe])
        return True
    except Exception:  # noqa: BLE001 - e.g. no float8 -> float32 copy kernel for this dtype here
        return False


def exactness(ctx, deadline):
    """Every dtype the device reads, in groups of at most MAX_FORMATS formats, a row each, written
    as it is checked, the deadline checked before each; then a call of eight formats, and on a GPU
    (first) one tensor over 2**31 elements. A group is one batch whose dtypes alternate, a multiple
    of eight tensors: each launch of the list kernel holds the group's formats and an unaligned
    tensor, so that a group compiles one variant of each kernel (a variant is a compile on a GPU,
    about a second or two: gpu_check's phase times project them)."""
    device, tiny, report = ctx.device, ctx.tiny, ctx.report
    cpu_note = ("the cpu backend" if cpu_be.unavailable_reason() is None
                else f"not the cpu backend ({cpu_be.unavailable_reason()})")
    print(f"  against the torch backend, {cpu_note} and the float64 oracle", flush=True)
    gen = torch.Generator().manual_seed(0)
    all_dtypes, wide_unsigned = check_dtypes()
    dtypes = [dtype for dtype in all_dtypes + wide_unsigned if _readable(dtype, device)]
    for dtype in sorted(set(all_dtypes + wide_unsigned) - set(dtypes), key=str):
        print(f"  {dtype}: skipped, not readable by the triton or the torch backend on {device}")
    size = triton_be.MAX_FORMATS
    groups = [dtypes[begin:begin + size] for begin in range(0, len(dtypes), size)]
    oracle_dtypes = set(all_dtypes)
    total = {"checked": 0, "cpu": 0}
    mismatches = []
    complete = True

    def checked(label, run, what):
        counts = {"checked": 0, "cpu": 0}
        try:
            run(counts)
        except Mismatch as error:
            mismatches.append(str(error))
            report.add(label, f"MISMATCH: {error}", f"after {counts['checked']} tensors exact; the groups after it still run")
        else:
            report.add(label, f"{counts['checked']} tensors exact", what + (f"; = cpu backend on {counts['cpu']}"
                                                                             if counts["cpu"] else ""))
        total["checked"] += counts["checked"]
        total["cpu"] += counts["cpu"]

    if not tiny:  # first: the one case that only a GPU's memory holds
        checked("exactness over 2**31 elements", lambda counts: counts.update(checked=check_huge(device)),
                "fp16 with its NaN, -inf and a subnormal past element 2**31, and int8: the int64 offsets")
    plan = [("exactness " + ", ".join(str(d)[6:] for d in group), group) for group in groups]
    plan.append(("exactness eight formats in one launch", dtypes[:2 * size]))
    for label, group in plan:
        if time.perf_counter() > deadline:
            complete = False
            print(f"  time box spent: stopped before {label}", flush=True)
            break
        if label.endswith("one launch"):
            checked(label, lambda counts, group=group: _check_formats(device, group, gen, counts, oracle_dtypes),
                    "one call of a tensor of each: two launches of the list kernel, the table kernels' partials in two")
        else:
            checked(label, lambda counts, group=group: _check_group(device, tiny, group, gen, counts, oracle_dtypes),
                    "table kernels = list kernel = torch backend = oracle (small ones); sizes around a chunk, special "
                    "values, empty, 0-dim, views made on the device")
    if mismatches:
        report.checks_failed.append("exactness")
        report.add("exactness", f"MISMATCH: {mismatches[0]}", f"{len(mismatches)} check(s) with a mismatch; "
                   f"{total['checked']} tensors exact; the phases after this one still run")
        return
    report.add("exactness", f"{total['checked']} tensors exact, 0 mismatches" + ("" if complete else " (time box: partial)"),
               f"in groups of at most {size} formats (rows above); table kernels = list kernel = torch backend = oracle "
               f"(small ones); = cpu backend on {total['cpu']}" + ("" if cpu_be.unavailable_reason() is None else
                                                                    f" ({cpu_note})"))


def _maker(dtype, wide_unsigned, gen):
    """Random bit patterns of ``dtype`` (host tensors), and its special values."""
    if dtype in wide_unsigned:
        signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        special = torch.tensor([0, -1, 1, torch.iinfo(signed).min], dtype=signed).view(dtype)
        return (lambda shape: random_bits(signed, shape, gen).view(dtype)), special
    return (lambda shape: random_bits(dtype, shape, gen)), special_values(dtype)


def _device_views(make, device):
    """Views made on the device (as a model's are): an unaligned start, one starting deep into a
    larger storage, a transposed and a permuted one (dense: read in place), gapped ones (read
    through a copy). A view the device cannot make for this dtype is left out."""
    views = []
    for build in (lambda: make((1001,)).to(device)[1:],
                  lambda: make((4096 + 300,)).to(device)[4096 + 3:4096 + 250],
                  lambda: make((40, 30)).to(device).t(),
                  lambda: make((4, 5, 6)).to(device).permute(2, 0, 1),
                  lambda: make((40, 30)).to(device)[:, ::7],
                  lambda: make((6, 8, 10)).to(device)[:, 1:7:2, ::3]):
        try:
            views.append(build())
        except (RuntimeError, NotImplementedError) as error:
            print(f"  a view left out on {device}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    return views


def _check_group(device, tiny, group, gen, counts, oracle_dtypes):
    """One batch of the dtypes of ``group``, alternating, a multiple of 8 tensors: for each, sizes
    around the chunk, special values, a tail after a chunk, empty, 0-dim and views on the device."""
    _, wide_unsigned = check_dtypes()
    chunk = triton_be.BLOCK_SIZE * triton_be.BLOCKS_PER_CHUNK
    sizes = [1, 7, 100, 4097] if tiny else [1, 7, 100, 4097, chunk - 1, chunk + 1, 2 * chunk + 77]
    each = []
    for dtype in group:
        make, special = _maker(dtype, wide_unsigned, gen)
        tensors = [make((n,)).to(device) for n in sizes]
        tensors += [special.to(device), torch.cat([make((chunk + 3,) if not tiny else (45,)), special]).to(device),
                    torch.empty(0, dtype=dtype, device=device), make(()).to(device)]
        each.append(tensors + _device_views(make, device))
    batch = [tensors[i] for i in range(max(len(t) for t in each)) for tensors in each if i < len(tensors)]
    while len(batch) % triton_be.MAX_SLOTS:
        batch.append(each[len(batch) % len(each)][0])  # the same tensor again: a multiple of 8
    counts["checked"] += check_batch(batch, ", ".join(str(d)[6:] for d in group), counts, oracle_dtypes)


def _check_formats(device, dtypes, gen, counts, oracle_dtypes):
    """One tensor of each of ``dtypes`` (eight formats) in one call: the list kernel's launch split
    by its formats, the table kernels' partials too."""
    _, wide_unsigned = check_dtypes()
    batch = []
    for i, dtype in enumerate(dtypes):
        make, _ = _maker(dtype, wide_unsigned, gen)
        tensor = make((50 + 31 * i + 1,)).to(device)
        batch.append(tensor[1:] if i % 3 == 1 else tensor)
    counts["checked"] += check_batch(batch, "eight formats", counts, oracle_dtypes)


def check_huge(device):
    """A tensor over 2**31 elements, its only NaN / -inf / subnormal past element 2**31: the int64 offsets."""
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 6 * n * 2:
        print(f"  skipped the {n}-element check: {free / 2**30:.0f} GiB free")
        return 0
    x = torch.ones(n, dtype=torch.float16, device=device)
    x[2**31 + 5] = float("nan")
    x[-1] = float("-inf")
    x[-2] = 2.0**-20
    table = triton_be.compute([x])
    got = _dicts(table, [x])[0]
    if not torch.equal(_read_rows([x]), table):
        raise Mismatch(f"fp16 tensor of {n} elements: the list kernel differs from the table kernels")
    want = {"abs_min": math.nan, "abs_max": math.nan, "nan": 1, "posinf": 0, "neginf": 1, "zero": 0,
            "subnormal": 1, "numel": n}
    if not same_stats(got, want):
        raise Mismatch(f"fp16 tensor of {n} elements: triton {got}, want {want}")
    x[2**31 + 5] = 3.0
    got = _dicts(triton_be.compute([x]), [x])[0]
    want.update(abs_min=2.0**-20, abs_max=math.inf, nan=0)
    if not same_stats(got, want):
        raise Mismatch(f"fp16 tensor of {n} elements: triton {got}, want {want}")
    del x
    y = torch.zeros(n, dtype=torch.int8, device=device)
    y[-1] = -128
    got = _dicts(triton_be.compute([y]), [y])[0]
    if (got["abs_max"], got["zero"]) != (128, n - 1):
        raise Mismatch(f"int8 tensor of {n} elements: {got}")
    return 3


def self_check(ctx, deadline):
    """The list kernel's self-check as on a device's first use, then again with its kernels
    compiled (every launch Triton's: a process's direct launches wait for the probe's verdict); a
    failure leaves the device on the table kernels for the phases after this one."""
    device = ctx.device
    state = None
    # on a GPU the second check runs with its kernels compiled, the figure that counts
    for attempt in ("first use",) if ctx.tiny else ("first use", "warm"):
        triton_be.forget_devices()
        state = triton_be.check_device(device, read=None if device.type == "cuda" else triton_list._read)
        print(f"  self-check ({attempt}): {state.self_check}, {state.check_ms:.0f} ms; path {state.path}; "
              f"launch {state.launch}", flush=True)
    passed = state.path == triton_be.LIST
    if not passed:
        ctx.report.checks_failed.append("self-check")
    launcher = state.launcher
    launches = ("no C++ launcher" if launcher is None else
                f"{launcher.direct_launches} direct and {launcher.ordinary_launches} ordinary launches")
    ctx.report.add("self-check", state.self_check if passed else f"failed: {state.self_check}",
                   f"{state.check_ms:.1f} ms" + ("" if ctx.tiny else " with its kernels compiled (target <= 50 ms)")
                   + f" ({launches}); path {state.path}; launch {state.launch}"
                   + (f"; the direct launch {state.probe}" if state.probe else ""))


# --------------------------------------------------------------------------- kernel timings

def make_timer(device):
    if device.type == "cuda":
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3
    else:
        def timer(fn):
            fn()
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)
    return timer


def copy_bandwidth(device, timer, numel):
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / seconds / 1e9, numel * 4


def fits(numel, dtype, device):
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return 8 * numel * dtype.itemsize < 0.8 * free  # the reference and torch backend make temporaries


def per_hook_path(device):
    """Whether ``device`` reads a hook's tensors with the list kernel (its self-check passed, or has
    not run)."""
    state = triton_devices.lookup(device)
    return state is None or state.path == triton_be.LIST


def bench_sizes(device, timer, sizes, dtypes, copy_gbps, deadline=math.inf):
    """One tensor at a time, with the kernel a hook's read uses on this device."""
    rows = []
    per_hook = per_hook_path(device)
    for dtype in dtypes:
        for numel in sizes:
            if time.perf_counter() > deadline:
                print(f"  skip {dtype} {numel}: time box spent")
                continue
            if not fits(numel, dtype, device):
                print(f"  skip {dtype} {numel}: does not fit comfortably")
                continue
            x = torch.randn(numel, device=device).to(dtype)
            out = torch.empty(1, 8, dtype=torch.int64, device=device)
            if per_hook:
                t_triton = timer(lambda x=x, out=out: triton_be.read_into([x], out))
            else:
                t_triton = timer(lambda x=x: triton_be.compute([x]))
            t_torch = timer(lambda x=x: torch_be.compute([x]))
            t_ref = timer(lambda x=x: _shared.reference_reads([x]))
            rows.append(result_row(f"{str(dtype)[6:]} x1", numel, numel * dtype.itemsize,
                                   t_triton, t_torch, t_ref, copy_gbps))
            print("  " + format_row(rows[-1]), flush=True)
            del x
    return rows


def mixed_tensors(device, count, lo, hi, seed=0):
    """A model's worth of tensors: log-uniform sizes, two thirds bf16, one third fp32."""
    rng = random.Random(seed)
    tensors = []
    for i in range(count):
        numel = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        dtype = torch.float32 if i % 3 == 2 else torch.bfloat16
        tensors.append(torch.randn(numel, device=device).to(dtype))
    return tensors


def bench_mixed(device, timer, tensors, copy_gbps):
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    t_triton = timer(lambda: triton_be.compute(tensors))
    t_torch = timer(lambda: torch_be.compute(tensors))
    t_ref = timer(lambda: _shared.reference_reads(tensors))
    row = result_row(f"mixed x{len(tensors)}", numel, nbytes, t_triton, t_torch, t_ref, copy_gbps)
    print("  " + format_row(row), flush=True)
    return row


def result_row(name, numel, nbytes, t_triton, t_torch, t_ref, copy_gbps):
    gbps = nbytes / t_triton / 1e9
    return {
        "case": name, "numel": numel, "MB": nbytes / 1e6,
        "triton_us": t_triton * 1e6, "GB/s": gbps, "%copy": 100 * gbps / copy_gbps,
        "torch_us": t_torch * 1e6, "ref_us": t_ref * 1e6,
        "x_ref": t_ref / t_triton, "x_torch": t_torch / t_triton,
    }


COLUMNS = [("case", "{:>12}"), ("numel", "{:>11}"), ("MB", "{:>9.2f}"), ("triton_us", "{:>10.1f}"),
           ("GB/s", "{:>7.0f}"), ("%copy", "{:>6.0f}"), ("torch_us", "{:>10.1f}"), ("ref_us", "{:>10.1f}"),
           ("x_ref", "{:>7.1f}"), ("x_torch", "{:>7.1f}")]


def format_row(row):
    return " ".join(fmt.format(row[key]) for key, fmt in COLUMNS)


def format_table(rows):
    header = " ".join(f"{key:>{len(fmt.format(rows[0][key])) if rows else 8}}" for key, fmt in COLUMNS)
    return "\n".join([header] + [format_row(r) for r in rows])


def bandwidth(ctx, deadline):
    device, report = ctx.device, ctx.report
    if ctx.tiny:
        sizes, mixed_spec, copy_numel = [4096], (6, 256, 2000), 2**20
    else:
        sizes = [s for s in (2**12, 2**16, 2**20, 2**24, 2**26, 2**28, 2**30) if s <= ctx.args.max_numel]
        mixed_spec, copy_numel = (300, 256, 270_000), 2**28
    timer = make_timer(device)
    ctx.copy_gbps, copy_bytes = copy_bandwidth(device, timer, copy_numel)
    report.add("copy bandwidth", f"{ctx.copy_gbps:.0f} GB/s", f"dst.copy_(src), {copy_bytes / 2**20:.0f} MiB fp32, read + write")
    rows = ctx.kernel_rows
    rows += bench_sizes(device, timer, sizes, (torch.float32, torch.bfloat16), ctx.copy_gbps, deadline)
    if time.perf_counter() < deadline:
        rows.append(bench_mixed(device, timer, mixed_tensors(device, *mixed_spec), ctx.copy_gbps))
    largest = {}
    for row in rows:
        largest[row["case"]] = row  # sizes ascend: the last one of a case is its largest
    for case, row in largest.items():
        kernel = "table kernels" if case.startswith("mixed") or not per_hook_path(device) else "list kernel"
        report.add(f"bandwidth {case.strip()} {row['numel']}", f"{row['GB/s']:.0f} GB/s ({row['%copy']:.0f}% of copy)",
                   f"{kernel} {row['triton_us']:.1f} us; {row['x_torch']:.1f}x faster than the torch backend, "
                   f"{row['x_ref']:.1f}x than the reference's ops (target >= 85% of copy at >= 256 MB)")
    if rows:
        one = "the list kernel" if per_hook_path(device) else "the table kernels (the self-check failed)"
        report.notes.append((f"kernel timings (medians; {one} for one tensor, the table kernels for the mixed "
                             "batch)", format_table(rows)))


SWEEP = [(block, warps) for block in (2048, 4096, 8192) for warps in (4, 8)]


def sweep_launch(x, block, warps):
    """The table kernels on ``x`` with BLOCK_SIZE ``block`` and ``warps`` warps, passed to the
    launch (each pair its own compiled kernel)."""
    return triton_be.compute([x], block_size=block, num_warps=warps)


def sweep(ctx, deadline):
    """GB/s of a few (BLOCK_SIZE, NUM_WARPS) at one size: evidence for the module defaults."""
    device = ctx.device
    numel = 2**16 if ctx.tiny else 2**28
    if ctx.copy_gbps is None:
        ctx.copy_gbps, _ = copy_bandwidth(device, make_timer(device), 2**20 if ctx.tiny else 2**28)
    timer = make_timer(device)
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        if not fits(numel, dtype, device):
            continue
        x = torch.randn(numel, device=device).to(dtype)
        for block, warps in SWEEP:
            if time.perf_counter() > deadline:
                lines.append(f"{str(dtype)[6:]:>9} BLOCK_SIZE={block:<5} NUM_WARPS={warps}: skipped, time box spent")
                continue
            seconds = timer(lambda x=x, block=block, warps=warps: sweep_launch(x, block, warps))
            gbps = numel * dtype.itemsize / seconds / 1e9
            lines.append(f"{str(dtype)[6:]:>9} BLOCK_SIZE={block:<5} NUM_WARPS={warps}: "
                         f"{gbps:7.0f} GB/s ({100 * gbps / ctx.copy_gbps:3.0f}% of copy)")
            print("  " + lines[-1], flush=True)
        del x
    best = max((line for line in lines if "GB/s" in line), key=lambda line: float(line.split(":")[1].split()[0]),
               default=None)
    ctx.report.add("launch-shape sweep", best.split(":")[0].strip() if best else "-",
                   f"the fastest of {len(lines)} table-kernel shapes at {numel} elements: {best.split(':')[1].strip() if best else '-'}")
    ctx.report.notes.append((f"launch-shape sweep at {numel} elements", "\n".join(lines)))


# --------------------------------------------------------------------------- training steps

REGIMES = {  # regime: (model, batch, sequence), dry-run (batch, sequence)
    "gpu-bound": ("gpt2", (8, 1024), (2, 16)),
    "host-bound": ("gpt2", (1, 512), (1, 8)),
    "large": ("llama", (2, 1024), (1, 16)),
}
EAGER_VARIANTS = ("none", "reference", "batch", "watch")
VARIANT_NOTES = {
    "none": "no detector",
    "reference": "transformers' DebugUnderflowOverflow",
    "batch": "DebugUnderflowOverflow(check='batch')",
    "watch": "watch(): check='batch', kwargs, containers, find_op, and the gradients read in backward",
    "compiled": "torch.compile of the model with DebugUnderflowOverflow(check='batch')",
    "compiled, no detector": "torch.compile of the model alone",
}


def gpt2_config(tiny):
    if tiny:  # the dry run: 1 layer, everything small
        return _shared.gpt2_config(1, 64, 2, 512, 64, bos_token_id=0, eos_token_id=0)
    return _shared.gpt2_config(**_shared.GPT2_SMALL)


def llama_config(tiny):
    import transformers

    if tiny:
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=64)
    # a few layers of a Llama-2-7B-sized model: the large-tensor regime
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                    max_position_embeddings=2048)


def regime_model(ctx, regime):
    """The regime's model (bf16, training mode, random weights), its token batch and a description."""
    import transformers

    kind, shape, tiny_shape = REGIMES[regime]
    batch, seq = tiny_shape if ctx.tiny else shape
    config = gpt2_config(ctx.tiny) if kind == "gpt2" else llama_config(ctx.tiny)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = (transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM)(config)
    model = model.to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=ctx.device)
    params = sum(p.numel() for p in model.parameters())
    layers, width = ((config.n_layer, config.n_embd) if kind == "gpt2"
                     else (config.num_hidden_layers, config.hidden_size))
    name = "GPT-2" if kind == "gpt2" else "Llama-style"
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    what = f"{name} {size} ({layers} layers, hidden {width}), bf16, batch {batch} x {seq}, AdamW"
    return model, ids, what


def attach(variant, model, tiny=False):
    """The model (or its compiled form) with ``variant``'s detector attached. The dry run compiles
    with aot_eager: dynamo and AOT autograd around the detector's ops as on a GPU, without
    inductor's CPU code generation (not what a GPU runs, and minutes on a small CPU)."""
    import overflow_fast

    backend = "aot_eager" if tiny else "inductor"
    if variant == "reference":
        from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

        ReferenceDetector(model)  # its hooks cannot be removed: this copy keeps them
    elif variant == "batch":
        overflow_fast.DebugUnderflowOverflow(model, check="batch")
    elif variant == "watch":
        overflow_fast.watch(model)
    elif variant == "compiled":
        overflow_fast.DebugUnderflowOverflow(model, check="batch")
        return torch.compile(model, backend=backend)
    elif variant == "compiled, no detector":
        return torch.compile(model, backend=backend)
    elif variant != "none":
        raise ValueError(variant)
    return model


def training_step(model, forward, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


class Steps:
    """Round-robin timing of training steps: {variant: step}, medians, peak memory above what was
    resident before each step, and why a variant stopped (it raised)."""

    def __init__(self, device):
        self.device = device
        self.steps = {}
        self.times = {}
        self.peaks = {}
        self.notes = {}

    def add(self, variant, step):
        self.steps[variant] = step
        self.times[variant] = []

    def run(self, variant):
        """One synced step; its seconds, or None when it raised (the variant is dropped)."""
        step = self.steps.get(variant)
        if step is None:
            return None
        cuda = self.device.type == "cuda"
        _sync(self.device)
        if cuda:
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            step()
            _sync(self.device)
        except Exception as error:  # noqa: BLE001 - a detection (ValueError) or anything else: a note
            message = str(error).strip().splitlines()
            self.notes[variant] = f"raised {type(error).__name__}: {message[0][:120] if message else ''}"
            print(f"  {variant}: {self.notes[variant]}", flush=True)
            del self.steps[variant]
            return None
        seconds = time.perf_counter() - start
        if cuda:
            self.peaks[variant] = max(self.peaks.get(variant, 0), torch.cuda.max_memory_allocated() - resident)
        return seconds

    def warm_up(self, count, deadline):
        """``count`` steps of each variant before timing (the allocator, the kernels' compiles, lazy
        buffers), the deadline checked before each: a variant left cold is not timed (its note says so)."""
        for round_ in range(count):
            for variant in list(self.steps):
                if time.perf_counter() > deadline:
                    if round_ == 0:
                        del self.steps[variant]
                        self.notes[variant] = "not measured: the time box was spent in the warm-up of the variants before it"
                        print(f"  {variant}: {self.notes[variant]}", flush=True)
                    continue
                self.run(variant)

    def rounds(self, count, deadline, after_round=None):
        """Round-robin timed steps, the deadline checked before each round after the first;
        ``after_round()`` after each (the rows written as soon as each variant has a median)."""
        for round_ in range(count):
            if round_ and time.perf_counter() > deadline:
                print(f"  time box spent after {round_} rounds", flush=True)
                break
            for variant in list(self.steps):
                seconds = self.run(variant)
                if seconds is not None:
                    self.times[variant].append(seconds)
            if after_round is not None:
                after_round()

    def median(self, variant):
        times = self.times.get(variant)
        return statistics.median(times) if times else None

    def detail(self, variant, what):
        parts = [VARIANT_NOTES.get(variant, variant), what]
        times = self.times.get(variant) or []
        parts.append(self.notes.get(variant, f"median of {len(times)} steps"))
        if variant in self.peaks:
            parts.append(f"step peak {self.peaks[variant] / 2**30:.2f} GiB above the resident")
        return "; ".join(parts)


def _relative(median, base):
    if median is None:
        return "-"
    if base is None:
        return f"{median * 1e3:.1f} ms"
    return f"{median * 1e3:.1f} ms ({100 * (median / base - 1):+.1f}%)"


def eager_steps(ctx, deadline, regime):
    """no detector, the reference, check="batch", watch(), each on its own copy of the model."""
    device, report = ctx.device, ctx.report
    base, ids, what = regime_model(ctx, regime)
    print(f"  {what}", flush=True)
    steps = Steps(device)
    for variant in EAGER_VARIANTS:
        model = copy.deepcopy(base)
        steps.add(variant, training_step(model, attach(variant, model), ids))
    ctx.regimes[regime] = (base, ids, what, steps.steps["none"])  # the compiled phase times against it
    warmup, count = (1, ctx.args.steps or 2) if ctx.tiny else (2, ctx.args.steps or 6)
    steps.warm_up(warmup, deadline)

    def write():
        base_median = steps.median("none")
        for variant in EAGER_VARIANTS:
            median = steps.median(variant)
            if median is not None or variant in steps.notes:
                report.set(f"step {regime} {variant}", _relative(median, None if variant == "none" else base_median),
                           steps.detail(variant, what))

    steps.rounds(count, deadline, write)
    if not any(steps.times.values()):
        write()  # no round ran: the notes of what was left cold
    steps.steps.clear()
    _free(device)


def compiled_steps(ctx, deadline, regime):
    """check="batch" under torch.compile, and torch.compile alone when the budget allows, timed
    against the eager step without a detector (the compile is in the warm-up)."""
    device, report = ctx.device, ctx.report
    if regime not in ctx.regimes:
        base, ids, what = regime_model(ctx, regime)
        model = copy.deepcopy(base)
        ctx.regimes[regime] = (base, ids, what, training_step(model, model, ids))
    base, ids, what, eager_none = ctx.regimes[regime]
    print(f"  {what}", flush=True)
    steps = Steps(device)
    steps.add("none", eager_none)
    compile_s = {}
    for variant in ("compiled", "compiled, no detector"):
        spent = max(compile_s.values(), default=0.0)
        if variant != "compiled" and time.perf_counter() + spent > deadline:
            steps.notes[variant] = f"skipped: its compile would not fit the time box (the first took {spent:.0f} s)"
            continue
        model = copy.deepcopy(base)
        steps.add(variant, training_step(model, attach(variant, model, ctx.tiny), ids))
        started = time.perf_counter()
        steps.run(variant)  # the compile: forward, then backward
        steps.run(variant)
        compile_s[variant] = time.perf_counter() - started
        print(f"  {variant}: warm-up (the compile) {compile_s[variant]:.1f} s", flush=True)
    steps.run("none")

    def write(final=False):
        eager = steps.median("none")
        alone = steps.median("compiled, no detector")
        for variant in ("compiled", "compiled, no detector"):
            median = steps.median(variant)
            if median is None and not final:
                continue
            if median is None:
                value = "-" if variant in steps.notes else "failed: no step ran"
            elif variant == "compiled" and alone is not None:
                value = f"{median * 1e3:.1f} ms ({100 * (median / alone - 1):+.1f}% vs compiled without the detector)"
            else:
                value = f"{median * 1e3:.1f} ms ({100 * (median / eager - 1):+.1f}% vs eager without a detector)" if eager else "-"
            detail = steps.detail(variant, what) + ("; backend aot_eager" if ctx.tiny else "; backend inductor")
            if variant in compile_s:
                detail += f"; warm-up with the compile {compile_s[variant]:.0f} s"
            if eager is not None:
                detail += f"; eager without a detector {eager * 1e3:.1f} ms in the same rounds"
            report.set(f"step {regime} {variant}", value, detail)

    steps.rounds((ctx.args.steps or 2) if ctx.tiny else (ctx.args.steps or 6), deadline, write)
    write(final=True)
    del ctx.regimes[regime]
    steps.steps.clear()
    _free(device)


# --------------------------------------------------------------------------- host us per hook

HOST_VARIANTS = ("none", "module", "batch", "watch", "defer")


def _zero_storages(values, seen):
    """Fill the storage under every tensor in ``values`` (nested tuples, lists, dicts) with zero
    bytes: uninitialised device memory may hold nan/inf bit patterns the detector would report."""
    if isinstance(values, torch.Tensor):
        storage = values.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            storage.fill_(0)
    elif isinstance(values, (tuple, list)):
        for value in values:
            _zero_storages(value, seen)
    elif isinstance(values, dict):
        for value in values.values():
            _zero_storages(value, seen)


def host_per_hook(ctx, deadline):
    """GPT-2 small's hook sequence replayed with bench_host_path.py's machinery on device tensors,
    through the path the run takes (the C++ launcher and the real driver): us per hook, launches per
    forward by kind, the launch path of each device and its self-check. Where the direct launch
    passed its probe and the time box allows, the same again with every launch Triton's."""
    import transformers

    import bench_host_path as hp

    device, tiny = ctx.device, ctx.tiny
    (batch, seq), repeats, inner = ((2, 16), 3, 1) if tiny else ((8, 1024), 5, 3)
    config = gpt2_config(tiny)
    with torch.device("meta"):
        meta_model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16).eval()
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")

    def forward():
        with torch.no_grad():
            meta_model(input_ids=ids)

    events, ops = hp.record(meta_model, forward)
    target = "cpu" if device.type != "cuda" else device
    model = copy.deepcopy(meta_model).to_empty(device=target)  # the same tree, on the device
    events = hp.materialize(events, empty_on=target)
    if device.type == "cuda":
        seen = set()
        for _, _, args, kwargs, output in events:
            _zero_storages((args, kwargs, output), seen)
        _zero_storages(list(model.parameters()) + list(model.buffers()), seen)
    hooks = sum(1 for event in events if event[0] == "post")
    what = (f"{hooks} hooks, {ops} ATen ops per forward ({config.n_layer} layers, n_embd {config.n_embd}, "
            f"batch {batch} x {seq}, bf16, no grad)" + ("; the count driver: launches counted, no kernel" if tiny else ""))
    print(f"  {what}", flush=True)

    def run():
        hp.replay(model, events)
        _sync(device)

    # the dry run: CPU tensors through the triton backend's host path, the driver call stubbed
    routing = hp.triton_on_cpu() if device.type != "cuda" else contextlib.nullcontext()
    with routing:
        started = time.perf_counter()
        label, direct = _host_pass(ctx, hp, model, run, hooks, what, repeats, inner, deadline, "")
        spent = time.perf_counter() - started
        if label != "direct":  # no direct launch to compare with Triton's
            return
        if time.perf_counter() + spent > deadline:
            ctx.report.add("host us/hook, ordinary launch", "skipped (time box)",
                           f"the direct launch's pass took {spent:.0f} s; the time box had "
                           f"{max(deadline - time.perf_counter(), 0):.0f} s left")
            return
        with ordinary_launch():
            _, ordinary = _host_pass(ctx, hp, model, run, hooks, what, repeats, inner, deadline, ", ordinary launch")
    ctx.report.add("host us/hook direct vs ordinary launch",
                   "; ".join(f"{v} {direct[v]:.1f} vs {ordinary[v]:.1f} us" for v in ("batch", "watch", "module")),
                   ("the count driver's launches (no kernel)" if ctx.tiny else "the direct launch (cuLaunchKernel from C++)")
                   + f" against Triton's own launch ({DIRECT_LAUNCH}=0), the same replays one after the other")


@contextlib.contextmanager
def ordinary_launch():
    """Every per-hook launch through Triton's own launch: OVERFLOW_FAST_DIRECT_LAUNCH=0, read when
    a device is set up, so the devices are set up afresh (self-check included) under it, and again
    after it."""
    from overflow_fast.stats import dispatch

    previous = os.environ.get(DIRECT_LAUNCH)
    os.environ[DIRECT_LAUNCH] = "0"
    triton_be.forget_devices()
    dispatch.forget_choices()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DIRECT_LAUNCH, None)
        else:
            os.environ[DIRECT_LAUNCH] = previous
        triton_be.forget_devices()
        dispatch.forget_choices()


def _host_pass(ctx, hp, model, run, hooks, what, repeats, inner, deadline, suffix):
    """Round-robin replays of every variant, then one counted forward of each: a row per variant,
    and the launch path of each device set up (``overflow-fast info``'s line). Returns how
    check="batch" launched ("direct", "ordinary", "direct and ordinary" or "none") and the us per
    hook of each variant."""
    times = {v: [] for v in HOST_VARIANTS}
    for round_ in range(repeats):  # round-robin rounds, stopped by the time box after the first
        if round_ and time.perf_counter() > deadline:
            print(f"  time box spent after {round_} rounds", flush=True)
            break
        for variant, seconds in hp.measure(model, run, HOST_VARIANTS, 1, inner).items():
            times[variant].append(seconds)
    medians = {v: statistics.median(t) for v, t in times.items()}
    counts = {variant: _counted_forward(hp, model, run, hooks, variant) for variant in HOST_VARIANTS[1:]}
    label = _launch_label(counts["batch"])
    per_hook = {v: (medians[v] - medians["none"]) / hooks * 1e6 for v in HOST_VARIANTS[1:]}
    for variant in HOST_VARIANTS[1:]:
        c = counts[variant]
        ctx.report.add(f"host us/hook {variant}{suffix}", f"{per_hook[variant]:.1f} us",
                       f"{what}; wall time of synced replays, medians of {len(times[variant])} rounds of {inner} "
                       f"(no hooks: {medians['none'] * 1e3:.2f} ms); per forward: {c['direct']} direct and "
                       f"{c['ordinary']} ordinary per-hook launches, {c['table']} table-kernel launches, "
                       f"{c['engine_calls']} Python engine calls ({c['engine_us']:.1f} us/hook in them)")
    for name, (path, check, launch) in triton_be.device_report().items():
        state = triton_devices.lookup(name)
        check_ms = f" ({state.check_ms:.1f} ms)" if state is not None and state.check_ms is not None else ""
        ctx.report.add(f"launch path {name}{suffix}", launch,
                       f"check='batch' launched {label}; {path}; self-check {check}{check_ms}; the line of "
                       f"`overflow-fast info` (the launcher's own predicate)"
                       + ("; the dry run's count driver launches without a self-check" if ctx.tiny else ""))
    return label, per_hook


def _launcher_launches():
    """(direct, ordinary) launches of the C++ launchers of every device set up so far."""
    direct = ordinary = 0
    for state in triton_devices._DEVICES.values():
        for launcher in [state.launcher] + [known[0] for known in state.shapes.values()]:
            if launcher is not None:
                direct += launcher.direct_launches
                ordinary += launcher.ordinary_launches
    return direct, ordinary


def _counted_forward(hp, model, run, hooks, variant):
    """One replayed forward of ``variant`` after a warm one: its launches by kind (the C++ launchers'
    direct and ordinary ones, the Python read's, the table kernels' two per call), and
    bench_host_path's count of the Python-side engine calls and the time in them."""
    calls = {"_launch": 0, "_launch_read": 0}
    owners = {"_launch": triton_table, "_launch_read": triton_list}  # the modules whose code calls them
    wrapped = {}
    for name in calls:  # counted, then the real function
        real = wrapped[name] = getattr(owners[name], name)

        def counting(*args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        setattr(owners[name], name, counting)
    try:
        detach = hp.attach(variant, model)
        try:
            run()
            before, called = _launcher_launches(), dict(calls)
            run()
            after, called = _launcher_launches(), {name: calls[name] - called[name] for name in calls}
        finally:
            detach()
        counts = hp.counted(model, run, variant, passes=1)
    finally:
        for name, real in wrapped.items():
            setattr(owners[name], name, real)
    return {"direct": after[0] - before[0], "ordinary": after[1] - before[1] + called["_launch_read"],
            "table": 2 * called["_launch"],
            "engine_calls": counts.get("compute_calls", 0), "engine_us": counts.get("compute_s", 0.0) / hooks * 1e6}


def _launch_label(counts):
    if counts["direct"] and counts["ordinary"]:
        return "direct and ordinary"
    return "direct" if counts["direct"] else "ordinary" if counts["ordinary"] else "none"


# --------------------------------------------------------------------------- bench_end_to_end

def end_to_end(ctx, deadline):
    script = os.path.join(HERE, "bench_end_to_end.py")
    timeout = max(deadline - time.perf_counter(), 1.0)
    try:
        result = subprocess.run([sys.executable, script, "--device", ctx.device.type, "--quick"],
                                capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        ctx.report.add("e2e", f"failed: stopped after {timeout:.0f} s (time box)", "")
        return
    print(result.stdout + result.stderr[-3000:], flush=True)
    last = (result.stdout.strip().splitlines() or ["-"])[-1]
    ctx.report.add("e2e", f"exit status {result.returncode}", f"bench_end_to_end.py --device {ctx.device.type} --quick: {last}")
    if result.returncode:
        ctx.report.phases_failed.append("e2e")


# --------------------------------------------------------------------------- main

RUNNERS = {
    "direct-launch": direct_launch,
    "exactness": exactness,
    "self-check": self_check,
    "bandwidth": bandwidth,
    "step-gpu-bound": lambda ctx, deadline: eager_steps(ctx, deadline, "gpu-bound"),
    "step-host-bound": lambda ctx, deadline: eager_steps(ctx, deadline, "host-bound"),
    "step-large": lambda ctx, deadline: eager_steps(ctx, deadline, "large"),
    "host-per-hook": host_per_hook,
    "compiled-gpu-bound": lambda ctx, deadline: compiled_steps(ctx, deadline, "gpu-bound"),
    "compiled-host-bound": lambda ctx, deadline: compiled_steps(ctx, deadline, "host-bound"),
    "compiled-large": lambda ctx, deadline: compiled_steps(ctx, deadline, "large"),
    "sweep": sweep,
    "e2e": end_to_end,
}


def run_phase(ctx, watchdog, name, box):
    """One phase in its time box; whatever goes wrong becomes a row."""
    report = ctx.report
    needs = dict((n, needs) for n, _, needs in PHASES)[name]
    missing = [f"{need} ({ctx.missing[need]})" for need in needs if ctx.missing.get(need)]
    if missing:
        report.phases_failed.append(name)
        report.finished.add(name)  # a second run lacks the same package
        report.add(name, "failed: needs " + ", ".join(missing), "")
        return
    if name == "sweep" and ctx.tiny is False and box < 10:
        report.add(name, "skipped (budget)", f"{box:.0f} s left for it")
        return
    watchdog.phase = name
    print(f"\n== {name} (time box {box:.0f} s, {time.perf_counter() - STARTED:.0f} s so far)", flush=True)
    started = time.perf_counter()
    try:
        # the phase's own checks stop at the box; the signal stops what overruns it
        with time_box(box + min(10.0, 0.25 * box), name):
            RUNNERS[name](ctx, started + box)
        report.finished.add(name)
    except TimeBoxSpent as error:
        report.phases_failed.append(name)
        report.add(name, f"failed: time box: {error}", f"stopped after {time.perf_counter() - started:.0f} s")
    except Exception as error:  # noqa: BLE001 - a failing phase is a row, and the next phase runs
        traceback.print_exc()
        report.finished.add(name)  # an error is the figure: rerunning asks for the same one
        report.phases_failed.append(name)
        message = str(error).strip().splitlines()
        report.add(name, f"failed: {type(error).__name__}: {message[0][:300] if message else ''}",
                   "the traceback is in gpu_check.log")
    finally:
        took = time.perf_counter() - started
        print(f"  ({name}: {took:.1f} s)", flush=True)
        report.phase_times.append((name, took, box, ctx.first_launches.take()))
        with contextlib.suppress(Exception):
            _free(ctx.device)


def phase_box(name, remaining, left):
    """The time box of ``name``, the first of the phases ``remaining``, with ``left`` seconds of the
    budget: a share of what is left, in proportion to the shares of the phases still to run, and
    at least its floor where that is at most half of what is left."""
    shares = dict((phase, share) for phase, share, _ in PHASES)
    box = left * shares[name] / sum(shares[n] for n in remaining)
    return max(box, min(FLOORS.get(name, 0.0), 0.5 * left))


def main(args):
    """Run the phases; return the exit status (the module docstring lists them)."""
    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, "gpu_check.log"), "a", buffering=1)
        sys.stdout = Tee(sys.__stdout__, log)
        sys.stderr = Tee(sys.__stderr__, log)
    report = Report(args.out, args.budget, args.dry_run)
    report.planned, report.left_out = list(args.selected), list(args.left_out)
    ctx = Context(args, report)
    watchdog = Watchdog(report, args.budget, log)
    print(f"gpu_check: phases {', '.join(args.selected)}; budget {args.budget:.0f} s"
          + ("; DRY RUN on CPU tensors (TRITON_INTERPRET=1)" if args.dry_run else ""), flush=True)
    if args.left_out:
        print(f"gpu_check: left to the next runs (a cold inductor compile each, one a run): "
              f"{COMMAND} --phases {args.left_out[0]}" + (" --dry-run" if args.dry_run else "")
              + (f", then {', '.join(args.left_out[1:])}" if args.left_out[1:] else ""), flush=True)
    report.write()
    try:
        ok = startup(ctx)
    except Exception as error:  # noqa: BLE001 - the package itself broken: a row, then the table
        traceback.print_exc()
        report.phases_failed.append("startup")
        report.add("startup", f"failed: {type(error).__name__}: {str(error)[:300]}", "the traceback is in gpu_check.log")
        ok = False
    if ok:
        report.phase_times.append(("startup", time.perf_counter() - STARTED, args.budget, []))
        ctx.first_launches.take()
        for i, name in enumerate(args.selected):
            left = STARTED + args.budget - RESERVE - time.perf_counter()
            box = phase_box(name, args.selected[i:], left)
            if box < MIN_PHASE:
                untried = ""
                if name == PROBE:  # never untried on the device
                    os.environ[DIRECT_LAUNCH] = "0"
                    report.probe = "skipped"
                    untried = f"; {DIRECT_LAUNCH}=0 for the rest of the run"
                report.add(name, "skipped (budget)", f"{max(left, 0):.0f} s of the budget left{untried}")
                continue
            run_phase(ctx, watchdog, name, box)
    elif not report.nothing_to_measure:
        report.nothing_to_measure = "the startup failed"
    watchdog.phase = "the end"
    watchdog.stop()
    with report.lock:
        report.finish()
    if log is not None:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        log.close()
    return report.status()


def cli(argv=None):
    """Run, then leave at once: nothing at interpreter exit (compile workers, CUDA teardown) can hang
    past the budget."""
    args = parse_args(argv)
    status = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    cli()
