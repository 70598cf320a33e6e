"""What the benchmark scripts share: the small GPT-2 they build, the loop that times variants, and
the measured run of a command in a child process.

``gpt2(...)`` is transformers' GPT2LMHeadModel from a config (``gpt2_config``), random weights
(nothing downloaded), seeded so that every variant of a script starts from the same weights;
``GPT2_SMALL`` is GPT-2 small's shape.

``round_robin(steps, repeats)`` times callables against each other on a shared, noisy machine:
the variants take turns within each round (the order reversed every other round, so none always
runs after the same neighbour), the first rounds only warm up (allocator, lazy init), and each
variant's median is returned. Only figures from the same call compare. A step that times a part
of itself (its own clock, its own setup left out) returns its seconds (``self_timed``).

``reference_reads(tensors)`` is the reference detector's own work on each tensor, to time against.

``command_measured(args)`` runs ``python -m overflow_fast ARGS`` in a child process: its wall and CPU
time and its peak resident memory. ``compare_commands`` times cases of such runs, this checkout's
beside another's (``--against``), run for run alternated.
"""

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time


GPT2_SMALL = dict(layers=12, width=768, heads=12, vocab=50257, positions=1024)


def gpt2_config(layers, width, heads, vocab, positions, **config):
    import transformers

    return transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                   n_positions=positions, **config)


def gpt2(layers, width, heads, vocab, positions, seed=0, device=None, **config):
    """A GPT2LMHeadModel of ``layers`` blocks of ``width``, random weights from ``seed``, made on
    ``device`` (``"meta"``: shapes only)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return transformers.GPT2LMHeadModel(gpt2_config(layers, width, heads, vocab, positions, **config))


def round_robin(steps, repeats, warm_up=2, synchronize=None, self_timed=False):
    """Median seconds per call of each of ``steps`` (name -> callable taking the round's index),
    over ``repeats`` rounds after ``warm_up`` untimed ones. ``synchronize``: called around each
    timed call (a device's queue drained, so the time is the step's). ``self_timed``: each step
    returns its own seconds, which count instead of the wall time around it."""
    names = list(steps)
    times = {name: [] for name in names}
    for index in range(warm_up + repeats):
        for name in (names if index % 2 == 0 else names[::-1]):
            if synchronize is not None:
                synchronize()
            start = time.perf_counter()
            seconds = steps[name](index)
            if synchronize is not None:
                synchronize()
            if index >= warm_up:
                times[name].append(seconds if self_timed else time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def reference_reads(tensors):
    """What transformers' DebugUnderflowOverflow does with each tensor: abs, its min and max
    formatted (a host read each), the nan and inf checks (one each)."""
    import torch

    for x in tensors:
        a = x.abs()
        _ = f"{a.min():8.2e} {a.max():8.2e}"
        torch.isnan(x).any().item()
        torch.isinf(x).any().item()


def command_measured(args, root=None, env=None):
    """(seconds, peak RSS in MB, stdout, CPU seconds) of one ``python -m overflow_fast ARGS`` run
    of this checkout (``root``: of the checkout there), in a child process (its resources from
    wait4()), with ``env`` added to the environment; a failed run raises."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **(env or {}), PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        # (run from the checkout: `python -m` puts the working folder first on sys.path)
        child = subprocess.Popen([sys.executable, "-m", "overflow_fast", *args], stdout=out, stderr=err, env=env,
                                 cwd=root)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if code != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({code}): {err.read().decode()[-2000:]}")
        return seconds, usage.ru_maxrss / 1024, out.read().decode(), usage.ru_utime + usage.ru_stime


def compare_commands(cases, runs, against=None, label_width=30, printed=None):
    """Time each case (label, size in MB, this checkout's args, the other checkout's args or None)
    ``runs`` times, this checkout's run and ``against``'s (a checkout's path) alternated; print a
    row per case and checkout: seconds, MB/s, CPU seconds, MB per CPU second (the figure load
    changes least), peak RSS (medians; RSS the largest). Returns {(label, "now" or "before"): stdout}."""
    print(f"{'case':<{label_width}} {'tree':<7} {'MB':>7} {'seconds':>8} {'MB/s':>7} {'CPU s':>7} {'MB/CPU s':>8} "
          f"{'peak RSS MB':>12}")
    outputs = {}
    for label, size, args, before, *env in cases:
        trees = [("now", None, args)] + ([("before", against, before)] if against and before else [])
        results = {tree: [] for tree, _, _ in trees}
        for index in range(runs):
            for tree, root, command in (trees if index % 2 == 0 else trees[::-1]):
                results[tree].append(command_measured(command, root, *env))
        for tree, _, _ in trees:
            measured = sorted(results[tree])
            seconds, _, out, cpu = measured[len(measured) // 2]
            rss = max(m[1] for m in measured)
            outputs[(label, tree)] = out
            print(f"{label:<{label_width}} {tree:<7} {size:7.0f} {seconds:8.2f} {size / seconds:7.1f} {cpu:7.2f} "
                  f"{size / cpu:8.1f} {rss:12.0f}", flush=True)
    return outputs
