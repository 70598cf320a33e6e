"""benchmarks/gpu_check.py returns what it measured whatever happens: a missing package, a failing
phase, a phase past its time box, a hang, a kill, a wrong kernel. Most tests give it stand-in phases
(its phases' work is not what they test) so that they run in seconds; the slow ones run the real
dry run."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")

# stand-in phases: the report and the time box are the real ones
STAND_INS = """
import time

def stand_in_startup(ctx):
    ctx.report.add("startup", "stand-in", "")
    return True

def records(name):
    def run(ctx, deadline):
        ctx.report.add(name, "measured", "")
    return run

def hangs(name, swallow):
    def run(ctx, deadline):
        ctx.report.add(name + " started", "yes", "")
        print("hanging in " + name, flush=True)
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                if not swallow:
                    raise

    return run

gpu_check.startup = stand_in_startup
"""


def launch(argv, setup="", before_import=""):
    """gpu_check.cli(argv) in a fresh interpreter, after ``setup`` (with ``gpu_check`` imported)."""
    code = "\n".join([
        before_import,
        "import sys",
        f"sys.path.insert(0, {BENCHMARKS!r})",
        "import gpu_check",
        textwrap.dedent(setup),
        f"gpu_check.cli({argv!r})",
    ])
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("OUT", None)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(process, timeout=300):
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def table(out):
    """The rows of ``out``/gpu_check.md as {measure: value} (the csv holds the same rows), and its
    first line."""
    with open(os.path.join(out, "gpu_check.md")) as f:
        text = f.read()
    with open(os.path.join(out, "gpu_check.csv")) as f:
        from_csv = {row["measure"]: row["value"] for row in csv.DictReader(f)}
    lines = text.splitlines()
    start = lines.index("| measure | value | detail | run |")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        measure, value, _detail, _run = (cell.strip() for cell in line[2:-2].split(" | "))
        rows[measure] = value
    assert rows == from_csv
    return rows, lines[0]


def test_missing_packages_are_rows_and_the_run_goes_on(tmp_path):
    # the real startup, without triton and without transformers
    process = launch(["--dry-run", "--phases", "exactness,step-host-bound", "--out", str(tmp_path)],
                     before_import="import sys; sys.modules['triton'] = None; sys.modules['transformers'] = None")
    status, output = finish(process)
    rows, headline = table(tmp_path)
    assert status == 3, output
    assert rows["exactness"].startswith("failed: needs triton"), rows
    assert rows["step-host-bound"].startswith("failed: needs transformers"), rows
    assert rows["startup"].endswith(" s"), rows
    assert headline.startswith("gpu_check: exit status 3") and "exactness, step-host-bound" in headline
    with open(tmp_path / "gpu_check.log") as f:
        log = f.read()
    assert "failed: needs triton" in log and "| measure | value | detail | run |" in log


def test_rows_are_written_as_they_come_and_survive_a_kill(tmp_path):
    process = launch(["--dry-run", "--phases", "exactness,bandwidth", "--out", str(tmp_path), "--budget", "300"],
                     STAND_INS + """
gpu_check.RUNNERS["exactness"] = records("exactness")
gpu_check.RUNNERS["bandwidth"] = hangs("bandwidth", swallow=True)
""")
    try:
        deadline = time.monotonic() + 120
        while "hanging in bandwidth" not in _read(tmp_path / "gpu_check.log"):
            assert process.poll() is None and time.monotonic() < deadline, _read(tmp_path / "gpu_check.log")
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        finish(process)
    rows, headline = table(tmp_path)
    assert rows == {"startup": "stand-in", "exactness": "measured", "bandwidth started": "yes"}
    assert headline.startswith("gpu_check: running (or killed: no end was written)"), headline
    assert "== bandwidth" in _read(tmp_path / "gpu_check.log")


def test_a_failing_phase_is_a_row_and_the_next_phase_runs(tmp_path):
    process = launch(["--dry-run", "--phases", "exactness,bandwidth", "--out", str(tmp_path)], STAND_INS + """
def fails(ctx, deadline):
    raise RuntimeError("the kernel failed to compile\\nsecond line")

gpu_check.RUNNERS["exactness"] = fails
gpu_check.RUNNERS["bandwidth"] = records("bandwidth")
""")
    status, output = finish(process)
    rows, headline = table(tmp_path)
    assert status == 3, output
    assert rows["exactness"] == "failed: RuntimeError: the kernel failed to compile", rows
    assert rows["bandwidth"] == "measured"
    assert "phases failed: exactness" in headline
    assert "Traceback" in _read(tmp_path / "gpu_check.log")


@pytest.mark.slow  # waits out time boxes in child processes; .ci/run runs it
def test_a_phase_past_its_time_box_is_a_row_and_the_watchdog_ends_a_hang(tmp_path):
    # self-check sleeps past its box (stopped there); sweep swallows even that: the watchdog ends
    # the run at the budget, with the table written
    budget = 8
    started = time.monotonic()
    process = launch(["--dry-run", "--phases", "self-check,sweep", "--out", str(tmp_path), "--budget", str(budget)],
                     STAND_INS + """
gpu_check.RUNNERS["self-check"] = hangs("self-check", swallow=False)
gpu_check.RUNNERS["sweep"] = hangs("sweep", swallow=True)
""")
    status, output = finish(process, timeout=budget + 60)
    elapsed = time.monotonic() - started
    rows, headline = table(tmp_path)
    assert status == 4, output
    assert rows["self-check"].startswith("failed: time box: self-check ran past its time box"), rows
    assert rows["sweep started"] == "yes", rows
    assert rows["sweep"].startswith(f"failed: stopped by the watchdog at {budget} s"), rows
    assert headline.startswith("gpu_check: exit status 4")
    assert elapsed < budget + 10, elapsed  # the interpreter's start, then the budget


# the direct-launch phase's child, stood in for (the real one runs in the slow dry run), and a
# phase after it that says what the run's later phases see
DIRECT_LAUNCH_STAND_INS = STAND_INS + """
import os

def child(code):
    gpu_check.probe_command = lambda args: [sys.executable, "-c", code]

def sees_direct_launch(ctx, deadline):
    ctx.report.add("later phase sees", os.environ.get("OVERFLOW_FAST_DIRECT_LAUNCH", "unset"), "")
    ctx.report.add("second run", ctx.report.second_run() or "none", "")

gpu_check.RUNNERS["bandwidth"] = gpu_check.RUNNERS["compiled-gpu-bound"] = sees_direct_launch
"""


def table_text(out):
    with open(os.path.join(out, "gpu_check.md")) as f:
        return f.read()


def test_a_direct_launch_that_kills_its_child_is_a_row_and_the_rest_runs_without_it(tmp_path):
    process = launch(["--dry-run", "--phases", "direct-launch,bandwidth", "--out", str(tmp_path)],
                     DIRECT_LAUNCH_STAND_INS + """
child("import os, sys; print('DIRECT', flush=True); "
      "print('CUDA error: an illegal memory access was encountered', file=sys.stderr, flush=True); os.abort()")
""")
    status, output = finish(process)
    rows, headline = table(tmp_path)
    assert status == 1, output
    assert rows["direct launch"] == ("failed: the probe died of SIGABRT (CUDA error: an illegal memory access was "
                                     "encountered)"), rows
    assert rows["later phase sees"] == "0", rows
    assert rows["second run"] == "OVERFLOW_FAST_DIRECT_LAUNCH=0 python3 benchmarks/gpu_check.py --phases bandwidth --dry-run"
    assert "checks failed: direct-launch" in headline


def test_a_probe_that_dies_before_its_first_direct_launch_is_not_measured(tmp_path):
    # no GPU memory left for the child, say: nothing is known of the direct launch
    process = launch(["--dry-run", "--phases", "direct-launch,bandwidth", "--out", str(tmp_path)],
                     DIRECT_LAUNCH_STAND_INS + """
child("raise MemoryError('CUDA out of memory')")
""")
    status, output = finish(process)
    rows, headline = table(tmp_path)
    assert status == 0, output
    assert rows["direct launch"] == ("not measured: before any direct launch: the probe ended with exit status 1 "
                                     "(MemoryError: CUDA out of memory)"), rows
    assert rows["later phase sees"] == "0", rows
    assert rows["second run"] == "python3 benchmarks/gpu_check.py --phases direct-launch,bandwidth --dry-run", rows


@pytest.mark.slow  # waits out time boxes in child processes; .ci/run runs it
def test_a_direct_launch_child_that_hangs_is_killed_at_its_time_box_and_not_measured(tmp_path):
    started = time.monotonic()
    # compiled-gpu-bound's large share leaves it time after the child's box
    process = launch(["--dry-run", "--phases", "direct-launch,compiled-gpu-bound", "--out", str(tmp_path), "--budget", "14"],
                     DIRECT_LAUNCH_STAND_INS + """
child("import time; print('DIRECT', flush=True); time.sleep(3600)")
""")
    status, output = finish(process, timeout=60)
    rows, _ = table(tmp_path)
    assert status == 0, output  # a probe out of time is no verdict, never a failed check
    assert rows["direct launch"].startswith("not measured: the probe ran past its "), rows
    assert rows["later phase sees"] == "0", rows
    assert time.monotonic() - started < 30


def test_a_direct_launch_left_untried_for_the_budget_stays_off(tmp_path):
    # the budget gives the child's phase less than a phase's least: skipped, and nothing launches directly
    process = launch(["--dry-run", "--phases", "direct-launch,compiled-gpu-bound", "--out", str(tmp_path), "--budget",
                      "5.5"], DIRECT_LAUNCH_STAND_INS + """
child("raise SystemExit('the child must not run')")
""")
    status, output = finish(process)
    rows, _ = table(tmp_path)
    assert status == 0, output
    assert rows["direct-launch"] == "skipped (budget)", rows
    assert rows["later phase sees"] == "0", rows


def test_a_direct_launch_that_passes_in_its_child_stays_on(tmp_path):
    result = {"passed": True, "stage": "direct", "self_check": "passed", "check_ms": 812.0,
              "launch": "direct (cuLaunchKernel from C++)", "reads": 16, "direct_launches": 37, "ordinary_launches": 20}
    process = launch(["--dry-run", "--phases", "direct-launch,bandwidth", "--out", str(tmp_path)],
                     DIRECT_LAUNCH_STAND_INS + f"child({'print(' + repr('PROBE ' + json.dumps(result)) + ')'!r})")
    status, output = finish(process)
    rows, _ = table(tmp_path)
    assert status == 0, output
    assert rows["direct launch"] == "passed: 37 direct launches in a child process", rows
    assert rows["later phase sees"] == "unset", rows
    assert rows["second run"] == "python3 benchmarks/gpu_check.py --phases bandwidth --dry-run", rows


def test_a_gpu_run_names_its_next_run_from_the_start(tmp_path):
    # the first run's phases skipped: this run takes the next compiled regime and names the last one's run at once
    first_run = [name for name in ("direct-launch", "exactness", "self-check", "bandwidth", "step-gpu-bound",
                                   "step-host-bound", "step-large", "host-per-hook", "compiled-gpu-bound", "sweep")]
    process = launch(["--out", str(tmp_path), "--skip", ",".join(first_run)],
                     STAND_INS + 'gpu_check.RUNNERS["compiled-host-bound"] = records("compiled-host-bound")\n')
    status, output = finish(process)
    command = "python3 benchmarks/gpu_check.py --phases compiled-large"
    assert status == 0, output
    assert output.splitlines()[:2] == [
        "gpu_check: phases compiled-host-bound; budget 330 s",
        f"gpu_check: left to the next runs (a cold inductor compile each, one a run): {command}"]
    assert f"Not measured (yet), for a second run: `{command}`" in table_text(tmp_path)
    assert table(tmp_path)[0]["compiled-host-bound"] == "measured"


def test_the_next_run_s_command():
    """One compiled regime a run, the next one first; the probe skipped once it passed (its verdict
    is kept), again where it was not measured, the direct launch off where it failed."""
    code = f"""
import sys
sys.path.insert(0, {BENCHMARKS!r})
import gpu_check
for probe in (None, "passed", "not taken", "not measured", "skipped", "failed"):
    for dry_run in (False, True):
        report = gpu_check.Report(None, 330, dry_run)
        report.planned = ["direct-launch", "exactness", "bandwidth", "compiled-gpu-bound", "sweep"]
        report.left_out = ["compiled-host-bound", "compiled-large"]
        report.finished = {{"direct-launch", "exactness", "sweep"}}
        report.probe = probe
        print(report.second_run())
"""
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    rest = "bandwidth,compiled-gpu-bound"
    assert output.splitlines() == [
        f"python3 benchmarks/gpu_check.py --phases {rest}",
        f"python3 benchmarks/gpu_check.py --phases {rest} --dry-run",
        f"python3 benchmarks/gpu_check.py --phases {rest} --skip direct-launch",
        f"python3 benchmarks/gpu_check.py --phases {rest} --dry-run",
        f"python3 benchmarks/gpu_check.py --phases {rest} --skip direct-launch",
        f"python3 benchmarks/gpu_check.py --phases {rest} --dry-run",
        f"python3 benchmarks/gpu_check.py --phases direct-launch,{rest}",
        f"python3 benchmarks/gpu_check.py --phases direct-launch,{rest} --dry-run",
        f"python3 benchmarks/gpu_check.py --phases direct-launch,{rest}",
        f"python3 benchmarks/gpu_check.py --phases direct-launch,{rest} --dry-run",
        f"OVERFLOW_FAST_DIRECT_LAUNCH=0 python3 benchmarks/gpu_check.py --phases {rest}",
        f"OVERFLOW_FAST_DIRECT_LAUNCH=0 python3 benchmarks/gpu_check.py --phases {rest} --dry-run",
    ]


def test_the_probe_and_the_self_check_get_their_floor():
    """The probe's child gets at least 60 s and the self-check 20 s where the budget allows (at most
    half of what is left); the other phases their share."""
    code = f"""
import sys
sys.path.insert(0, {BENCHMARKS!r})
import gpu_check
selected = gpu_check.parse_args([]).selected
print(gpu_check.gpu_boxes(selected, startup_s=20.0))
print(gpu_check.phase_box("direct-launch", selected, 30.0))
"""
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    boxes = eval(lines[0])  # noqa: S307 - our own dict of floats
    assert boxes["direct-launch"] >= 60.0 and boxes["self-check"] >= 20.0, boxes
    assert abs(sum(boxes.values()) - (330 - 2 - 20)) < 1e-6, boxes  # the whole budget, nothing more
    assert float(lines[1]) == 15.0  # half of what is left, where 60 s is not there


def test_the_phases_of_a_run():
    code = f"""
import sys
sys.path.insert(0, {BENCHMARKS!r})
import gpu_check
for argv in ([], ["--phases", "compiled-large,exactness"], ["--phases", "exactness", "--skip", "direct-launch"],
             ["--dry-run"], ["--dry-run", "--phases", "exactness", "--budget", "90"],
             ["--phases", "compiled-host-bound,compiled-large", "--skip", "direct-launch"]):
    args = gpu_check.parse_args(argv)
    print(",".join(args.selected), ",".join(args.left_out), args.budget, sep="|")
"""
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first = ("direct-launch,exactness,self-check,bandwidth,step-gpu-bound,step-host-bound,step-large,host-per-hook,"
             "compiled-gpu-bound,sweep")
    assert output.splitlines() == [
        f"{first}|compiled-host-bound,compiled-large|330.0",  # one compiled regime a run, the most valuable first
        "direct-launch,exactness,compiled-large||330.0",  # the direct launch first on a GPU, whatever --phases says
        "exactness||330.0",
        f"{first}|compiled-host-bound,compiled-large|1200.0",  # the dry run runs what a GPU run runs; no device time to keep
        "exactness||90.0",
        "compiled-host-bound|compiled-large|330.0",
    ]


# a step phase's real code on stand-in models: each variant's step sleeps; ``slow`` says which
# variant's which call takes how long (3600: hangs)
STEP_STAND_INS = STAND_INS + """
import time as _time
import types

def step_startup(ctx):
    ctx.device = types.SimpleNamespace(type="cpu")  # all a step phase asks of it here
    return stand_in_startup(ctx)

gpu_check.startup = step_startup

class Model:
    pass

gpu_check.regime_model = lambda ctx, regime: (Model(), None, "a stand-in model")
gpu_check.attach = lambda variant, model, tiny=False: variant if variant != "none" else model
calls = {}

def training_step(model, forward, ids):
    variant = forward if isinstance(forward, str) else "none"

    def step():
        calls[variant] = calls.get(variant, 0) + 1
        _time.sleep(slow.get((variant, calls[variant]), 0.02))

    return step

gpu_check.training_step = training_step
"""


@pytest.mark.slow  # waits out time boxes in child processes; .ci/run runs it
def test_a_step_phase_writes_each_variant_s_row_as_soon_as_it_has_a_median(tmp_path):
    # watch() hangs in its third step (the second timed round): the first round's rows are there
    process = launch(["--dry-run", "--phases", "step-gpu-bound,compiled-gpu-bound", "--out", str(tmp_path), "--budget",
                      "20", "--steps", "4"], STEP_STAND_INS + 'slow = {("watch", 3): 3600}\n'
                     'gpu_check.RUNNERS["compiled-gpu-bound"] = records("compiled-gpu-bound")\n')
    status, output = finish(process, timeout=60)
    rows, _ = table(tmp_path)
    assert status == 3 and rows["compiled-gpu-bound"] == "measured", output
    assert rows["step-gpu-bound"].startswith("failed: time box"), rows
    assert rows["step gpu-bound none"].endswith(" ms"), rows
    for variant in ("reference", "batch", "watch"):
        assert rows[f"step gpu-bound {variant}"].endswith("%)"), rows


@pytest.mark.slow  # waits out time boxes in child processes; .ci/run runs it
def test_a_warm_up_past_the_deadline_leaves_the_variants_after_it_cold_and_says_so(tmp_path):
    # the reference's first step (its warm-up) takes the whole box: the variants after it are not timed
    process = launch(["--dry-run", "--phases", "step-gpu-bound,compiled-gpu-bound", "--out", str(tmp_path), "--budget",
                      "30"], STEP_STAND_INS + 'slow = {("reference", 1): 6.5}\n'
                     'gpu_check.RUNNERS["compiled-gpu-bound"] = records("compiled-gpu-bound")\n')
    status, output = finish(process, timeout=60)
    rows, _ = table(tmp_path)
    assert status == 0 and rows["compiled-gpu-bound"] == "measured", output
    assert rows["step gpu-bound none"].endswith(" ms") and rows["step gpu-bound reference"].endswith("%)"), rows
    for variant in ("batch", "watch"):
        assert rows[f"step gpu-bound {variant}"] == "-", rows
    assert "not measured: the time box was spent in the warm-up" in table_text(tmp_path)


@pytest.mark.slow  # every setting compiled and run through Triton's interpreter; .ci/run runs it
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the interpreter records the launches")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_the_sweep_launches_each_setting_as_a_kernel_of_its_own(monkeypatch):
    """Each (BLOCK_SIZE, NUM_WARPS) of the sweep reaches the launch (recorded under the interpreter,
    the same statistics each time), and two settings are two kernels: compiled for sm_90 (no GPU
    needed) with what was launched, their metadata differ."""
    import torch

    sys.path.insert(0, BENCHMARKS)
    import gpu_check
    from overflow_fast.stats import triton_backend, triton_kernels

    monkeypatch.setattr(gpu_check, "triton_be", triton_backend)
    launched = []
    real = triton_kernels._stats_partials_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "_stats_partials_kernel", Recording())
    x = torch.randn(3 * 8192 * 16 + 5)
    first, second = gpu_check.SWEEP[0], gpu_check.SWEEP[-1]
    rows = [gpu_check.sweep_launch(x, block, warps) for block, warps in (first, second)]
    assert torch.equal(rows[0], rows[1])
    assert [(k["BLOCK_SIZE"], k["num_warps"]) for k in launched] == [first, second]
    code = f"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from overflow_fast.stats import triton_kernels
for kwargs in json.loads({json.dumps(json.dumps(launched))}):
    options = {{"num_warps": kwargs.pop("num_warps")}}
    options.update((k, kwargs.pop(k)) for k in ("maxnreg",) if k in kwargs)
    kernel = triton.compile(ASTSource(triton_kernels._stats_partials_kernel, {{"Table_ptr": "*i64", "num_tensors": "i64",
                            **{{k: "constexpr" for k in kwargs}}}}, kwargs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    print("KERNEL", kernel.metadata.num_warps, kernel.hash)
"""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if "ptxas" in done.stderr and "FileNotFoundError" in done.stderr:
        pytest.skip("no ptxas in this triton install")
    kernels = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("KERNEL ")]
    assert len(kernels) == 2, done.stdout + done.stderr[-3000:]
    assert [int(k[0]) for k in kernels] == [first[1], second[1]] and kernels[0][1] != kernels[1][1]


@pytest.mark.slow
def test_a_wrong_kernel_is_a_row_and_the_measuring_goes_on(tmp_path):
    # the per-hook read off by one: exactness and the self-check say so, and the bandwidth is
    # measured all the same (on the table kernels)
    process = launch(["--dry-run", "--phases", "exactness,self-check,bandwidth", "--out", str(tmp_path)], """
from overflow_fast.stats import triton_list

real_read = triton_list._read

def off_by_one(tensors, out, *args, **kwargs):
    taken = real_read(tensors, out, *args, **kwargs)
    out[-1, 5] += 1  # one zero count wrong
    return taken

triton_list._read = off_by_one
""")
    status, output = finish(process)
    rows, headline = table(tmp_path)
    assert status == 1, output
    assert rows["exactness"].startswith("MISMATCH: "), rows
    assert rows["self-check"].startswith("failed: "), rows
    assert rows["copy bandwidth"].endswith(" GB/s"), rows
    assert any(measure.startswith("bandwidth float32") for measure in rows), rows
    assert "checks failed: exactness, self-check" in headline


@pytest.mark.slow
def test_the_dry_run_measures_every_phase(tmp_path):
    process = launch(["--dry-run", "--out", str(tmp_path)])  # the dry run's own budget
    status, output = finish(process, timeout=1300)
    rows, headline = table(tmp_path)
    assert status == 0, output
    assert "0 mismatches" in rows["exactness"] and rows["self-check"] == "passed", rows
    assert rows["exactness float32, float64, float16, bfloat16"].endswith(" tensors exact"), rows  # a row per group
    # the real child: no direct launch under the interpreter, its self-check and reads exact
    assert rows["direct launch"] == "not taken: ordinary (the interpreter runs the kernels (TRITON_INTERPRET=1))", rows
    for regime in ("gpu-bound", "host-bound", "large"):
        assert rows[f"step {regime} none"].endswith(" ms"), rows
        for variant in ("reference", "batch", "watch"):
            assert rows[f"step {regime} {variant}"].endswith("%)"), rows
    assert rows["step gpu-bound compiled"].endswith(")"), rows  # one compiled regime a run
    for variant in ("module", "batch", "watch"):
        assert rows[f"host us/hook {variant}"].endswith(" us"), rows
        assert rows[f"host us/hook {variant}, ordinary launch"].endswith(" us"), rows  # the count driver, then Triton's
    assert rows["launch path cpu, ordinary launch"] == "ordinary (OVERFLOW_FAST_DIRECT_LAUNCH=0)", rows
    assert rows["host us/hook direct vs ordinary launch"].startswith("batch "), rows
    text = table_text(tmp_path)
    assert "Not measured (yet), for a second run: `python3 benchmarks/gpu_check.py --phases compiled-host-bound --dry-run`" in text
    assert "phase times (here; on a GPU: projected)" in text and "first compiles" in text
    # one counted forward each: the same per-hook launches on either path, defer's one table call (two launches)
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| host us/hook ")}
    direct = re.search(r"per forward: (\d+) direct and 0 ordinary per-hook launches, 0 table", lines["host us/hook batch"])
    assert direct and int(direct.group(1)) > 0, lines["host us/hook batch"]
    assert f"per forward: 0 direct and {direct.group(1)} ordinary" in lines["host us/hook batch, ordinary launch"]
    assert "per forward: 0 direct and 0 ordinary per-hook launches, 2 table-kernel" in lines["host us/hook defer"]
    with open(tmp_path / "gpu_check.csv") as f:
        assert all(row["run"].startswith("dry-run") for row in csv.DictReader(f))  # every figure marked


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""
