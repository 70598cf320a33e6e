"""Host work of the GPU path per hook, measured without a GPU, and what it would add to a training
step on an H200 (a projection).

On a GPU the CPU only issues kernels, so what a hook costs the step is its host work: Python, the
hook's one C++ call (the reuse check, each tensor's checks and launch arguments, the launch),
launches and uploads. This script runs that host work for real and stubs one thing, the driver
call:

- The path: CPU tensors are routed to the ``triton`` backend (``supports`` and
  ``unavailable_reason`` patched, ``dispatch.preferring("cpu", "triton")``), and each device's
  C++ launcher is made with the "count" driver (``triton_launch._launcher_driver`` patched):
  everything before the driver call runs as on a GPU, the launch predicate included (it reads the
  installed Triton's real launch hooks); the driver call counts the launch and its programs and
  writes zero rows (finite: nothing detected). A non-dense tensor's flat copy (an ATen kernel on a
  GPU) is an uninitialised tensor there, counted. Calls the per-hook kernel does not take (more
  than 32 tensors: ``defer=True``'s one call per forward) go to the table kernels, whose two
  ``kernel[grid](...)`` calls are stubbed (counted; the combine stub zeroes its rows, about 1 us a
  real launch does not spend); their upload (on CUDA a pinned copy) is counted and costed in the
  projection (UPLOAD_US).
- The forward: ``GPT2LMHeadModel`` with GPT-2 small's module tree (12 layers, n_embd 768, 12
  heads, vocab 50257, random weights from a config, nothing downloaded) in bf16 runs one forward on
  the **meta device** with ``input_ids`` of batch 8 x 1024 tokens (``--batch``, ``--seq``); every
  module call (pre and post, args, kwargs, output) is recorded, then **replayed**: each meta tensor
  becomes an uninitialised CPU tensor of the same shape, strides and dtype (virtual memory, never
  written or read), the same meta tensor always the same CPU tensor (so the detector's reuse of
  rows works as in a real run), and the parameters are those of the same model built by
  ``to_empty(device="cpu")``. The replay calls each module's hooks as ``Module.__call__`` does,
  with grad enabled and the activations requiring grad as in a training forward (``--no-grad``:
  as in an inference forward): what is timed is the hooks alone, without the model's own ops (on
  a GPU they run on the device) and without torch's hook-calling path in ``Module.__call__``.
  The same activations come back at every replayed forward; ``--fresh-activations`` gives each
  forward new ones, as training does (a view of each recorded activation, made in the timed
  replay and so in the no-hook time it subtracts): torch's hook registration on a tensor costs
  more the first time.
- The backward (``watch()`` reads each parameter's gradient and each hooked output's gradient):
  the same module tree at small widths (n_embd 96, vocab 512, batch 1 x 16, fp32) trained for real
  on the CPU through the same path, one torch thread; timed: the host time inside its gradient
  hooks and the flush that ends the pass (a whole backward is too noisy on a shared machine to
  subtract; torch's own call of each Python hook, about a microsecond, is not in it). A hook's
  host work does not depend on its tensors' sizes, and the tree gives the hooks, so the backward's
  hooks and us per hook are GPT-2 small's; the bytes those hooks read on the GPU (GPT-2 small's
  parameters and hooked outputs at the measured batch, bf16) are computed from the recorded
  forward.

Measured side by side in one process, medians of round-robin runs, in the CPU time of the thread
that runs the hooks (``time.thread_time``: a shared machine's other processes stretch wall time,
not the work): no hooks (the replay loop), a
no-op forward hook on every module, a "floor" hook (flatten the call as the reference does and
keep each tensor with its version counter: the least a hook does in Python), check="module",
check="batch", ``watch()`` and check="batch" with ``defer=True``. Host us per hook = (replay
time - no-hook replay time) / hooks. An instrumented extra replay per variant counts launches
(direct: the launcher's; ordinary: through Triton, 0 unless a launch hook is set), uploads,
programs, tensors and bytes read, copies, Python-side engine calls and their time, and the
end-of-forward ``flush``. ``--profile [VARIANT]`` adds cProfile's top functions of a variant (check="batch" by default).
``--targets``: the floor, check="batch" and ``watch()`` timed alone and their ratios to the floor
(what the host targets are held to). ``--collector N``: the cyclic collector's collections and their time over N forwards in a row of
check="batch" and ``watch()`` (what a hook leaves alive until its pass ends can make the collector
run a full collection every few thousand forwards, which the short timed rounds never meet).

The CPU backend's host figures (``--no-cpu`` skips them): the same model on CPU, fp32, real
weights, one real forward of batch 1 x 8 tokens (``--cpu-seq``) recorded and replayed on its real
tensors, the CPU launcher (the C++ kernel on the packed arguments) reading them.

Then ``project()``: the added time of one training step on an H200 (its model and constants
printed) in two regimes: GPU-bound (GPT-2 small at 8 x 1024: the host runs ahead of the GPU) and
host-bound (batch 1 x 512: the GPU waits for the host, so every host microsecond is step time).
The last line is, for check="batch" in the GPU-bound regime:

    host us/hook: X; launches/forward: Y; uploads/forward: Z; projected H200 step overhead: W%

    .venv/bin/python benchmarks/bench_host_path.py [--quick] [--layers N] [--repeats R]
        [--profile [VARIANT]] [--targets] [--collector N] [--no-cpu] [--no-backward] [--csv PATH]
"""

import argparse
import contextlib
import ctypes
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

import overflow_fast
import overflow_fast.hooks.reads
import overflow_fast.stats.kinds
from overflow_fast import DebugUnderflowOverflow
from overflow_fast.hooks.passes import Passes
from overflow_fast.hooks.frames import forward_items
from overflow_fast.stats import (cpu_backend, dispatch, triton_backend, triton_common, triton_devices, triton_kernels,
                                 triton_launch, triton_list, triton_table)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

# -- the projection's model (H200-class GPU, GPT-2 small, bf16) ------------------------------------
GEMM_TFLOPS = 600.0  # dense bf16 GEMMs
HBM_TBPS = 3.0  # achieved memory bandwidth: the model's other ops and the detector's kernels
STEP_MS = 50.0  # GPU time of one training step of GPT-2 small at 8 x 1024 tokens (forward 1/3 of it)
# host cost of one launch on the driver (cuLaunchKernel from the launcher): 5 us until a GPU has
# measured it (benchmarks/gpu_check.py); everything before the driver call is measured here
TRITON_LAUNCH_US = 5.0
ATEN_LAUNCH_US = 5.0  # host cost of one ATen CUDA kernel launch (a .contiguous() copy)
UPLOAD_US = 6.0  # pinned staging (caching host allocator) + cudaMemcpyAsync enqueue, per upload
KERNEL_MIN_US = 3.0  # smallest duration of a kernel on the GPU
SYNC_US = 25.0  # one host read: wait for the stream, D2H copy of the rows, wake up
MODEL_OP_HOST_US = 10.0  # the model's own host work per ATen op on a GPU (Python, dispatch, launch)
HOST_BOUND = (1, 512)  # the host-bound regime's batch x tokens

# The host work of the GPU path is timed in CPU time of the thread that runs it (time.thread_time):
# on a shared machine, other processes stretch wall time but not the work itself (instrumented()'s
# timers follow CLOCK, which cpu_path leaves at wall time for the C++ kernel's thread team).
CLOCK = [time.thread_time]

VARIANTS = ("none", "noop", "floor", "module", "batch", "watch", "defer")
DETECTORS = VARIANTS[3:]
TARGETS = ("none", "floor", "batch", "watch")  # --targets: the ratios, timed alone


# -- stubs: the GPU-only steps of the Triton path -----------------------------------------------------

class Counters:
    def __init__(self):
        self.reset()

    def reset(self):
        self.compute_calls = 0  # engine calls from Python (tensor_stats, read_into, compute)
        self.tensors = 0
        self.bytes = 0
        self.launches = 0
        self.ordinary = 0  # of the launches: through Triton's launch (a launch hook set)
        self.programs = 0
        self.uploads = 0
        self.table_ints = 0
        self.copies = 0
        self.copy_bytes = 0
        self.compute_s = 0.0
        self.flush_s = 0.0
        self.flush_before_read_s = 0.0  # of flush_s: before its host read (the final engine call, ...)
        self.described = []  # lists of tensors the triton tables describe, summed by settle()
        self.calls = []  # per read of the hook layer: the counters before and after it
        self.device_s = 0.0  # the modeled GPU time of the detector's kernels (settle())
        self.reading = False  # inside a read noted by _per_read

    def settle(self):
        """Add the described tensors to ``tensors`` and ``bytes``, and each read's kernels to
        ``device_s`` (summed here, not in the timed calls: the sums cost more than the C++ table
        itself). A read's launches take the longer of its bytes at HBM_TBPS and KERNEL_MIN_US each."""
        sizes = [sum(t.numel() * t.element_size() for t in tensors) for tensors in self.described]
        for tensors, size in zip(self.described, sizes):
            self.tensors += len(tensors)
            self.bytes += size
        for (launcher, launches, described), (launcher_after, launches_after, described_after) in self.calls:
            count = launcher_after["launches"] - launcher["launches"] + launches_after - launches
            size = launcher_after["bytes"] - launcher["bytes"] + sum(sizes[described:described_after])
            if count:
                self.device_s += max(count * KERNEL_MIN_US / 1e6, size / (HBM_TBPS * 1e12))
        self.described = []
        self.calls = []

    def mark(self):
        return launcher_counters(), self.launches, len(self.described)


def _per_read(real):
    """A read of the hook layer (``Reads.add_forward``, ``Reads.add``, ``Reads.read``) noting the
    counters around it; one inside another (``add_forward`` falling back on ``add``) is the outer
    one's."""
    def call(self, *args, **kwargs):
        if COUNT.reading:
            return real(self, *args, **kwargs)
        before = COUNT.mark()
        COUNT.reading = True
        try:
            return real(self, *args, **kwargs)
        finally:
            COUNT.reading = False
            COUNT.calls.append((before, COUNT.mark()))
    return call


COUNT = Counters()
_LAUNCHER_COUNTERS = (("direct_launches", "launches"), ("ordinary_launches", "launches"), ("programs", "programs"),
                      ("tensors_read", "tensors"), ("bytes_read", "bytes"), ("copies", "copies"),
                      ("copy_bytes", "copy_bytes"))


def launcher_counters():
    """The C++ launchers' counters, summed over the devices set up so far (a CUDA device's too)."""
    totals = dict.fromkeys(("launches", "programs", "tensors", "bytes", "copies", "copy_bytes"), 0)
    for state in triton_devices._DEVICES.values():
        for launcher in [state.launcher] + [known[0] for known in state.shapes.values()]:
            if launcher is not None:
                for name, total in _LAUNCHER_COUNTERS:
                    totals[total] += getattr(launcher, name)
    return totals


class _StubKernel:
    """Stands for a Triton kernel: ``kernel[grid](...)`` counts one launch and its programs."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            COUNT.launches += 1
            COUNT.programs += grid[0]
            if self.name == "combine":
                # the rows the kernel would write (its argument Out_ptr): zeros (finite, nothing
                # detected); about 1 us of host time per call that a real launch does not spend
                args[1].zero_()
        return launch


def _ordinary_launch(state, launcher, grid, args, *rest):
    """Triton's own launch of a per-hook variant, counted (taken only while a launch hook is set;
    its kernel cannot run on these CPU tensors): zero rows."""
    COUNT.ordinary += 1
    ctypes.memset(args[0], 0, 64 * sum(1 for numel in args[3:2 + 3 * triton_backend.MAX_SLOTS:3] if numel != -1))


def _python_read_launch(programs, args, *rest):
    """The Python read's launch (no extension), counted: zero rows."""
    COUNT.launches += 1
    COUNT.programs += programs
    _ordinary_launch(None, None, programs, args)
    COUNT.ordinary -= 1


def _counting_launch(real):
    def launch(buffer, out, num_tensors, num_chunks, *args):
        COUNT.uploads += 1  # on CUDA: one copy from the pinned staging buffer per call (_buffer)
        COUNT.table_ints += 4 * num_tensors + 1  # the table at the start of buffer (_table)
        return real(buffer, out, num_tensors, num_chunks, *args)
    return launch


_REAL_FLAT_SOURCE = triton_table._flat_source


def _flat_source(tensor):
    """triton_table._flat_source, except that the copy of a non-dense tensor (one ATen kernel on
    a GPU) is counted and stands as an uninitialised tensor: its data are never read here."""
    if tensor.is_neg() or tensor.is_contiguous() or triton_table._is_dense(tensor):
        return _REAL_FLAT_SOURCE(tensor)
    COUNT.copies += 1
    COUNT.copy_bytes += tensor.numel() * tensor.element_size()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _counting_table(real):
    """triton_table._table (the Python table) counting the tensors it describes."""
    def table(sources, words, chunk):
        COUNT.described.append(sources)
        return real(sources, words, chunk)
    return table


def _counting_scan(real):
    """triton_backend.scan (the table built by the C++ loop) counting the tensors it describes."""
    def scan(tensors, *args, **kwargs):
        scanned = real(tensors, *args, **kwargs)
        if scanned is not None:
            COUNT.described.append(tensors)
        return scanned
    return scan


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _count_driver(device):
    """The launcher's driver on these CPU tensors: "count", the stand-in for the GPU's driver call
    (or, as on a GPU, "ordinary" under OVERFLOW_FAST_DIRECT_LAUNCH=0)."""
    if triton_common._EXTENSION is None:
        return None, "the C++ extension is unavailable"
    if os.environ.get("OVERFLOW_FAST_DIRECT_LAUNCH", "1") == "0":
        return "ordinary", "OVERFLOW_FAST_DIRECT_LAUNCH=0"
    return "count", None


@contextlib.contextmanager
def triton_on_cpu():
    """Route CPU tensors to the triton backend (as under TRITON_INTERPRET=1), its host work real,
    the driver call of its launches and its table kernels' launches stubbed."""

    def supports(tensor):
        return (tensor.device.type == "cpu" and tensor.dtype in triton_backend.SUPPORTED_DTYPES
                and tensor.layout == torch.strided)

    with contextlib.ExitStack() as stack:
        for obj, name, value in (
            # the face's names are the dispatch's, the owners' the backend's own calls
            (triton_backend, "supports", supports),
            (triton_common, "supports", supports),
            (triton_backend, "unavailable_reason", lambda: None),
            (triton_common, "unavailable_reason", lambda: None),
            (triton_kernels, "_stats_partials_kernel", _StubKernel("partials")),
            (triton_kernels, "_stats_combine_kernel", _StubKernel("combine")),
            (triton_list, "_launch_read", _python_read_launch),  # the Python read (no extension)
            (triton_launch, "_launcher_driver", _count_driver),
            (triton_launch, "_ordinary_launch", _ordinary_launch),
            (triton_table, "_launch", _counting_launch(triton_table._launch)),
            (triton_table, "_flat_source", _flat_source),
            (triton_table, "_table", _counting_table(triton_table._table)),
            (triton_backend, "scan", _counting_scan(triton_backend.scan)),
            (triton_table, "scan", _counting_scan(triton_table.scan)),
            (overflow_fast.stats.kinds, "CPU_AS_DEVICE", True),  # these CPU tensors stand for GPU ones
        ):
            stack.enter_context(patched(obj, name, value))
        stack.enter_context(dispatch.preferring("cpu", "triton"))
        triton_backend.forget_devices()
        try:
            yield
        finally:
            triton_backend.forget_devices()


@contextlib.contextmanager
def instrumented():
    """Time spent in the Python-side engine calls (``compute``, ``read_into``: the calls the
    launcher bound to the core did not take), in the detector's flush and, of it, before the
    flush's host read (an extra, counted pass)."""
    real_compute = triton_backend.compute
    real_flush = Passes.flush
    real_cpu = torch.Tensor.cpu
    flush_start = [None]  # while a flush runs: when it started, until its first host read

    def cpu(tensor, *args, **kwargs):
        # on a GPU the host read waits for the device: what the flush did before it (engine calls
        # of deferred tensors, the bookkeeping that needs no rows) overlaps the device's work
        if flush_start[0] is not None:
            COUNT.flush_before_read_s += CLOCK[0]() - flush_start[0]
            flush_start[0] = None
        return real_cpu(tensor, *args, **kwargs)

    depth = [0]  # compute() runs scan() and compute_scanned(): time the outermost call only

    def timed(real, counts_call):
        def call(*args, **kwargs):
            depth[0] += 1
            start = CLOCK[0]()
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    COUNT.compute_calls += counts_call
                    COUNT.compute_s += CLOCK[0]() - start
        return call

    # the backend's work: compute(), or where dispatch builds the table in C++ itself, scan()
    # then compute_scanned() (one engine call)
    compute = timed(real_compute, 1)
    scan = timed(triton_backend.scan, 0)
    compute_scanned = timed(triton_backend.compute_scanned, 1)
    own_scan = timed(triton_table.scan, 0)  # compute()'s own calls, in the table module
    own_compute_scanned = timed(triton_table.compute_scanned, 1)
    real_read = triton_backend.read_into

    def read_into(tensors, out, *args, **kwargs):  # the per-hook kernel's Python entry: one engine call
        taken = timed(real_read, 1)(tensors, out, *args, **kwargs)
        if not taken:
            COUNT.compute_calls -= 1  # declined: the call that follows counts
        return taken

    def flush(self, current):
        start = flush_start[0] = CLOCK[0]()
        try:
            return real_flush(self, current)
        finally:
            flush_start[0] = None
            COUNT.flush_s += CLOCK[0]() - start

    dispatch.forget_choices()  # the hook layer's cached entry: the timed one from now on
    reads = overflow_fast.hooks.reads.Reads
    with patched(triton_backend, "compute", compute), patched(triton_backend, "scan", scan), \
            patched(triton_backend, "read_into", read_into), \
            patched(triton_backend, "compute_scanned", compute_scanned), patched(Passes, "flush", flush), \
            patched(triton_table, "scan", own_scan), patched(triton_table, "compute_scanned", own_compute_scanned), \
            patched(torch.Tensor, "cpu", cpu), patched(reads, "add_forward", _per_read(reads.add_forward)), \
            patched(reads, "add", _per_read(reads.add)), patched(reads, "read", _per_read(reads.read)):
        try:
            yield
        finally:
            dispatch.forget_choices()


# -- the model, the recorded hook sequence and its replay ---------------------------------------------

def gpt2_small(layers, device, dtype):
    return _shared.gpt2(**dict(_shared.GPT2_SMALL, layers=layers), device=device).to(dtype).eval()


def record(model, forward):
    """The forward's module calls in the order torch runs their hooks: ("pre" | "post", module name,
    args, kwargs, output). Also the number of ATen ops the forward ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {m: n for n, m in model.named_modules()}
    events = []
    handles = []

    def pre(module, args, kwargs):
        events.append(("pre", names[module], args, kwargs, None))

    def post(module, args, kwargs, output):
        events.append(("post", names[module], args, kwargs, output))

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    try:
        with Counter():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return events, Counter.ops


def _tensors_replaced(events, replace):
    """``events`` with each tensor of their calls (in tuples, named tuples, lists and dicts) replaced
    by ``replace(tensor)``, the same tensor always by the same replacement."""
    memo = {}  # id -> (tensor, its replacement): the tensor kept, so that its id is not reused

    def convert(value):
        if isinstance(value, torch.Tensor):
            known = memo.get(id(value))
            if known is None:
                known = memo[id(value)] = (value, replace(value))
            return known[1]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(convert(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(convert(v) for v in value)
        if isinstance(value, dict):
            converted = {k: convert(v) for k, v in value.items()}
            return type(value)(**converted) if type(value) is not dict else converted
        return value

    return [(kind, name, convert(args), convert(kwargs), convert(output))
            for kind, name, args, kwargs, output in events]


def materialize(events, empty_on="cpu", requires_grad=False):
    """The events with every meta tensor replaced by an uninitialised CPU tensor of the same size,
    strides and dtype (``torch.empty_strided``: virtual memory only, never written), the same meta
    tensor always by the same CPU tensor, so the detector's reuse of rows works as in a real run.
    ``requires_grad``: floating-point activations require grad, as in a training forward (where
    autograd keeps them until backward, so staging them costs no memory of its own)."""
    def empty(value):
        if not value.is_meta:
            return value
        tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=empty_on)
        if requires_grad and tensor.is_floating_point():
            tensor.requires_grad_()
        return tensor

    return _tensors_replaced(events, empty)


def fresh_activations(events):
    """``events`` with each activation that requires grad replaced by a new view of itself (the same
    tensor always by the same view): what a training forward hands its hooks, tensors never seen
    before that autograd made."""
    return _tensors_replaced(events, lambda tensor: tensor.view_as(tensor) if tensor.requires_grad else tensor)


def replay(model, events, grad=False):
    """Run the hooks of ``model`` on the recorded calls, as Module.__call__ would (pre hooks when a
    module's forward starts, forward hooks when it ends; with_kwargs honoured), under no_grad, or
    with ``grad`` as in a training forward (watch() then hooks the outputs' gradients)."""
    modules = dict(model.named_modules())
    with torch.set_grad_enabled(grad):
        for kind, name, args, kwargs, output in events:
            module = modules[name]
            if kind == "pre":
                with_kwargs = module._forward_pre_hooks_with_kwargs
                for hook_id, hook in list(module._forward_pre_hooks.items()):
                    if hook_id in with_kwargs:
                        hook(module, args, kwargs)
                    else:
                        hook(module, args)
            else:
                with_kwargs = module._forward_hooks_with_kwargs
                for hook_id, hook in list(module._forward_hooks.items()):
                    if hook_id in with_kwargs:
                        hook(module, args, kwargs, output)
                    else:
                        hook(module, args, output)


def replay_root(model, events):
    """``replay`` of the root's own events (its module looked up once, not per call)."""
    for kind, _, args, kwargs, output in events:
        hooks = model._forward_pre_hooks if kind == "pre" else model._forward_hooks
        with_kwargs = model._forward_pre_hooks_with_kwargs if kind == "pre" else model._forward_hooks_with_kwargs
        for hook_id, hook in list(hooks.items()):
            if kind == "pre":
                hook(model, args, kwargs) if hook_id in with_kwargs else hook(model, args)
            else:
                hook(model, args, kwargs, output) if hook_id in with_kwargs else hook(model, args, output)


def attach(variant, model):
    """Hooks for ``variant``; returns a function that takes them off."""
    if variant == "none":
        return lambda: None
    if variant == "noop":
        handles = []
        model.apply(lambda m: handles.append(m.register_forward_hook(lambda *a: None)))
        return lambda: [h.remove() for h in handles]
    if variant == "floor":
        # the least a staging hook does in Python: flatten its call as the reference does and keep
        # each tensor with its version counter (what the detector adds to this is its own cost)
        staged = []
        handles = [model.register_forward_pre_hook(lambda *a: staged.clear())]

        def stage(module, args, output):
            for value, _ in forward_items(module, args, output):
                if isinstance(value, torch.Tensor):
                    staged.append((value, value._version))

        model.apply(lambda m: handles.append(m.register_forward_hook(stage)))
        return lambda: [h.remove() for h in handles]
    if variant in ("module", "batch"):
        detector = DebugUnderflowOverflow(model, check=variant)
    elif variant == "defer":
        detector = DebugUnderflowOverflow(model, check="batch", defer=True)
    elif variant == "watch":
        detector = overflow_fast.watch(model)
    elif variant == "step":
        detector = overflow_fast.watch(model, check="step")
    else:
        raise ValueError(variant)
    return detector.remove


def measure(model, run, variants, repeats, inner, clock=time.perf_counter):
    """Median seconds per replayed forward of each variant, by ``clock`` (round-robin; each round
    attaches the variant's hooks, warms them with one forward and times ``inner`` more)."""
    def timed(variant):
        def step(index):
            detach = attach(variant, model)
            try:
                run()  # warm: lazy buffers, backend choice, the launcher bound to the core
                start = clock()
                for _ in range(inner):
                    run()
                return (clock() - start) / inner
            finally:
                detach()
        return step

    medians = _shared.round_robin({variant: timed(variant) for variant in variants}, repeats, warm_up=0,
                                  self_timed=True)
    COUNT.reset()
    return medians


TIMED_COUNTERS = ("compute_s", "flush_s", "flush_before_read_s")


def counted(model, run, variant, passes=7):
    """Instrumented replays of ``variant``: the counters of one (the launchers' included), the timed
    ones the medians of ``passes`` replays (a single flush is too short to time alone on a shared
    machine)."""
    detach = attach(variant, model)
    snapshots = []
    try:
        run()
        with instrumented():
            for _ in range(passes):
                COUNT.reset()
                before = launcher_counters()
                run()
                after = launcher_counters()
                COUNT.settle()
                snapshot = dict(vars(COUNT))
                for name, value in after.items():
                    snapshot[name] += value - before[name]
                snapshots.append(snapshot)
    finally:
        detach()
    COUNT.reset()
    snapshot = snapshots[0]
    for name in TIMED_COUNTERS:
        snapshot[name] = statistics.median(s[name] for s in snapshots)
    return snapshot


def collector(model, run, variant, forwards):
    """The cyclic collector's work during ``forwards`` replays of ``variant`` in a row, as a long
    training meets it (the timed rounds are too short to see a full collection): per generation,
    collections and their wall time, from ``gc.callbacks``."""
    per_generation = {}
    started = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
            return
        count, seconds = per_generation.get(info["generation"], (0, 0.0))
        per_generation[info["generation"]] = (count + 1, seconds + time.perf_counter() - started.pop())

    detach = attach(variant, model)
    try:
        run()
        gc.collect()
        gc.callbacks.append(callback)
        try:
            for _ in range(forwards):
                run()
        finally:
            gc.callbacks.remove(callback)
    finally:
        detach()
    return per_generation


def profile(model, run, variant, forwards, top):
    detach = attach(variant, model)
    try:
        run()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(forwards):
            run()
        profiler.disable()
    finally:
        detach()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    text = stream.getvalue()
    # the header and the rows, without the blank padding pstats prints
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines)


# -- the backward: watch()'s gradient reads ---------------------------------------------------------

class _OpCounter:
    """Counts the ATen ops run under it (a TorchDispatchMode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops = 0
        self.mode = Mode

    def count(self, fn):
        self.ops = 0
        with self.mode():
            result = fn()
        return self.ops, result


def small_widths(layers, dtype=torch.float32):
    """GPT-2 small's module tree (its hooks) at small widths: n_embd 96 (12 heads of 8), vocab 512,
    in training mode."""
    return _shared.gpt2(layers, 96, 12, 512, 64).to(dtype).train()


def model_ops(layers):
    """ATen ops of one training step of the tree (the same counts at any width and batch): forward,
    backward, a fused AdamW's step after its first (a GPU run's optimizer: a few launches; the
    first step's state allocation and the CPU's per-tensor foreach loops are not a GPU step's)."""
    model = small_widths(layers)
    ids = torch.zeros((1, 16), dtype=torch.long)
    counter = _OpCounter()
    forward_ops, loss = counter.count(lambda: model(input_ids=ids, labels=ids).loss)
    backward_ops, _ = counter.count(loss.backward)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    optimizer.step()
    optimizer_ops, _ = counter.count(optimizer.step)
    return forward_ops, backward_ops, optimizer_ops


def backward_path(args):
    """watch()'s backward on the tree at small widths, through the GPU path's host work: the median
    over backwards of the host time spent in its gradient hooks and in the flush that ends the pass
    (timed inside them: a backward's own time is too noisy on a shared machine to subtract; torch's
    call of each Python hook, about a microsecond, is not in it), and its counters in one backward
    (``hooks``: the gradient hook calls)."""
    from overflow_fast.hooks.gradients import GradientHooks

    model = small_widths(args.layers)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    spent = [0.0, 0]  # seconds inside the hooks and the flush, hook calls

    def timed(real, counts):
        def call(*a, **k):
            start = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                spent[0] += time.thread_time() - start
                spent[1] += counts
        return call

    def backward():
        loss = model(input_ids=ids, labels=ids).loss
        spent[:] = [0.0, 0]
        loss.backward()
        model.zero_grad(set_to_none=True)
        return spent[0]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model's own kernels: no thread team to wait for on a shared machine
    try:
        with triton_on_cpu(), patched(GradientHooks, "_parameter_hook", timed(GradientHooks._parameter_hook, 1)), \
                patched(GradientHooks, "_output_hook", timed(GradientHooks._output_hook, 1)), \
                patched(Passes, "_backward_ended", timed(Passes._backward_ended, 0)):
            detach = attach("watch", model)
            try:
                backward()  # warm: the launcher bound, the rows allocated
                seconds = statistics.median(backward() for _ in range(args.repeats * args.inner))
                loss = model(input_ids=ids, labels=ids).loss
                spent[:] = [0.0, 0]
                COUNT.reset()
                before = launcher_counters()
                with instrumented():
                    loss.backward()
                after = launcher_counters()
                COUNT.settle()
                counts = dict(vars(COUNT))
                for name, value in after.items():
                    counts[name] += value - before[name]
                counts["hooks"] = spent[1]
            finally:
                detach()
                model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    COUNT.reset()
    return seconds, counts


def step_path(args, model, run, events):
    """check="step" on the same replay: the root's two hooks per forward (its outputs read: the
    root's own calls replayed, the other modules have no hook), and at the backward's end every
    parameter's gradient read (the model's parameters given uninitialised gradients: virtual
    memory), timed directly; the gradient hooks on the root's outputs and the
    callbacks that reach the backward's end timed in a real backward of a one-op graph (with and
    without them). Returns ``(forward host s, forward counts, backward host s, backward counts,
    forward bytes, backward bytes)``."""
    from overflow_fast.replay.sandbox import call_state
    from overflow_fast.replay.step import KeptForward

    forward_counts = counted(model, run, "step")
    root_outputs = [t for kind, name, _, _, output in events if kind == "post" and name == ""
                    for t in _tensors(output)]
    forward_bytes = sum(t.numel() * t.element_size() for t in root_outputs)
    detector = overflow_fast.watch(model, check="step")
    guard = detector._passes
    parameters = [p for p in model.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.empty_like(parameter)
    kept = KeptForward((), {}, None, call_state(), 0)

    def backward_end():
        guard.through = [kept]
        start = time.thread_time()
        guard._backward_ends()
        return time.thread_time() - start

    root = [event for event in events if event[1] == ""]

    def forward():
        # the root's own calls alone (the other modules have no hook): the replay of its two events,
        # with new activations each time as training makes them (a hook registered on a root output
        # per forward), as Module.__call__ calls its hooks
        calls = fresh_activations(root)
        start = time.thread_time()
        replay_root(model, calls)
        return time.thread_time() - start

    samples = args.repeats * args.inner * 30
    try:
        with torch.enable_grad():
            forward()
            forward_s = statistics.median(forward() for _ in range(samples))
        backward_end()
        read_s = statistics.median(backward_end() for _ in range(samples))
        with instrumented():
            COUNT.reset()
            before = launcher_counters()
            backward_end()
            after = launcher_counters()
        backward_counts = dict(vars(COUNT))
        for name, value in after.items():
            backward_counts[name] += value - before[name]
        hooks_s = _root_gradient_hooks(guard, args.repeats * args.inner * 20)
    finally:
        detector.remove()
        for parameter in parameters:
            parameter.grad = None
    COUNT.reset()
    backward_bytes = sum(p.numel() * p.element_size() for p in parameters)
    return forward_s, forward_counts, read_s + hooks_s, backward_counts, forward_bytes, backward_bytes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _root_gradient_hooks(guard, samples):
    """Host seconds of check="step"'s backward beyond its read: the gradient hook on a root output
    and the two callbacks that reach the backward's end (a one-op graph's backward with them,
    minus without; its end reads nothing here)."""
    from overflow_fast.replay.sandbox import call_state
    from overflow_fast.replay.step import KeptForward

    kept = KeptForward((), {}, None, call_state(), 0)
    reading = guard.reading
    reading.gradients()  # (its parameters found)
    parameters, owners = reading.parameters, reading.owners
    reading.parameters, reading.owners = [], []
    x = torch.ones(4, requires_grad=True)
    gradient = torch.ones(4)

    def one(hooked):
        y = x * 2
        if hooked:
            guard._watch_gradients(kept, y)
        start = time.thread_time()
        y.backward(gradient)
        return time.thread_time() - start

    try:
        for hooked in (False, True):
            one(hooked)
        with_hooks, without = [], []
        for _ in range(samples):
            without.append(one(False))
            with_hooks.append(one(True))
    finally:
        reading.parameters, reading.owners = parameters, owners
    return max(0.0, statistics.median(with_hooks) - statistics.median(without))


def gradient_sizes(model, events):
    """The bytes of each gradient watch() reads in one backward of the recorded forward: each
    parameter's (the model's dtype) and each distinct floating output's, as the forward hooks
    flatten them. One gradient hook reads one of them."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    seen = set()
    modules = dict(model.named_modules())
    for kind, name, args, kwargs, output in events:
        if kind != "post":
            continue
        for value, ctx in forward_items(modules[name], args, output):
            if (isinstance(value, torch.Tensor) and ctx.startswith("output") and value.is_floating_point()
                    and id(value) not in seen):
                seen.add(id(value))
                sizes.append(value.numel() * value.element_size())
    return sizes


# -- the projection ----------------------------------------------------------------------------------

def gpt2_gpu_model(batch, seq, layers=12, d=768, vocab=50257):
    """GPU time of one GPT-2-small training step from FLOPs and bytes (ms), and its parts."""
    tokens = batch * seq
    gemm_params = layers * 12 * d * d + d * vocab  # qkv, proj, fc, fc-proj; lm_head
    attention = layers * 2 * 2 * batch * seq * seq * d  # QK^T and AV (no causal saving)
    forward_flops = 2 * tokens * gemm_params + attention
    gemm_ms = 3 * forward_flops / (GEMM_TFLOPS * 1e12) * 1e3
    # other ops, bf16: per layer about 16 reads+writes of a [tokens, d] tensor (layer norms,
    # residual adds, bias, dropout) and 8 of [tokens, 4d] (GELU), plus softmax over the logits
    # (read, write in fp32, read again); backward about twice the forward's traffic
    per_forward = layers * (16 * tokens * d + 8 * tokens * 4 * d) * 2 + tokens * vocab * (2 + 4 + 4)
    other_ms = 3 * per_forward / (HBM_TBPS * 1e12) * 1e3
    return gemm_ms, other_ms


class Regime:
    """One training step's GPU time and the model's own host time, per pass (ms): ``gpu`` and
    ``host`` as (forward, backward, optimizer)."""

    def __init__(self, name, gpu, host):
        self.name, self.gpu, self.host = name, gpu, host

    @property
    def baseline(self):
        """Without a detector nothing syncs: the host runs ahead, the step is the longer of the two."""
        return max(sum(self.gpu), sum(self.host))


def regimes(batch, seq, ops):
    """The GPU-bound regime (the measured batch: STEP_MS of GPU time, forward a third of it) and the
    host-bound one (HOST_BOUND: its modeled GPU time scaled by STEP_MS over the measured batch's
    model); the model's host work MODEL_OP_HOST_US per ATen op, the same op counts in both."""
    forward_ops, backward_ops, optimizer_ops = ops
    host = (forward_ops * MODEL_OP_HOST_US / 1e3, backward_ops * MODEL_OP_HOST_US / 1e3,
            optimizer_ops * MODEL_OP_HOST_US / 1e3)
    measured = sum(gpt2_gpu_model(batch, seq))
    small = sum(gpt2_gpu_model(*HOST_BOUND)) * STEP_MS / measured
    return (Regime(f"GPU-bound ({batch} x {seq})", (STEP_MS / 3, 2 * STEP_MS / 3, 0.0), host),
            Regime(f"host-bound ({HOST_BOUND[0]} x {HOST_BOUND[1]})", (small / 3, 2 * small / 3, 0.0), host))


def pass_cost(counts, hooks, us_per_hook, device_ms):
    """The detector's host and GPU time in one pass (ms), and of its flush, the part after the host
    read (ms): its hooks' measured host work (the flush included) plus the driver's share of each
    launch, upload and copy; on the GPU its kernels (``device_ms``, modeled: each read's launches
    take the longer of its bytes at HBM_TBPS and KERNEL_MIN_US each) and its copies (read and
    written once more)."""
    gpu = device_ms + (2 * counts["copy_bytes"] / (HBM_TBPS * 1e12) + counts["copies"] * KERNEL_MIN_US / 1e6) * 1e3
    host = (hooks * us_per_hook + counts["launches"] * TRITON_LAUNCH_US + counts["uploads"] * UPLOAD_US
            + counts["copies"] * ATEN_LAUNCH_US) / 1e3
    after_read = (counts["flush_s"] - counts["flush_before_read_s"]) * 1e3
    return host, gpu, after_read


def project(regime, check, passes):
    """Added step time (ms) and overhead (fraction) of a detector in ``regime``; ``passes``: the
    (host, gpu, after_read) of each pass it hooks, forward first (``pass_cost``), the backward's
    None where it has no hooks there.

    check="batch" (and watch()): a pass ends with one host read (SYNC_US), so the host can no longer
    run ahead of it: the pass takes the longer of the host's issue (the model's ops and the hooks,
    the flush up to its host read) and the GPU's work (the model's and the detector's kernels),
    then the sync, the rest of the flush with the GPU idle, and one launch's worth of bubble before
    the GPU has work again. What follows the last synced pass (the backward without hooks, the
    optimizer) runs ahead as without a detector.
    check="module": every hook syncs, so the GPU idles while the detector's host work runs: the
    forward takes its own time plus all of the detector's work and a sync per hook (SYNC_US)."""
    step = 0.0
    synced = 0
    for index, cost in enumerate(passes):
        if cost is None:
            break
        host, gpu, after_read = cost[:3]
        if check == "module":
            hooks, per_hook_host = cost[3], host
            step += max(regime.host[index], regime.gpu[index]) + gpu + per_hook_host + hooks * SYNC_US / 1e3
        else:
            step += (max(regime.host[index] + host - after_read, regime.gpu[index] + gpu) + SYNC_US / 1e3
                     + after_read + ATEN_LAUNCH_US / 1e3)
        synced = index + 1
    step += max(sum(regime.host[synced:]), sum(regime.gpu[synced:]))
    return step - regime.baseline, step / regime.baseline - 1


# -- main ----------------------------------------------------------------------------------------

def host_path(args, csv_rows):
    layers, batch, seq = args.layers, args.batch, args.seq
    meta_model = gpt2_small(layers, "meta", torch.bfloat16)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")

    def forward():
        with torch.no_grad():
            meta_model(input_ids=ids)

    grad = not args.no_grad
    print(f"== Triton path host work: GPT-2 small tree ({layers} layers, n_embd 768, 12 heads), bf16, "
          f"batch {batch} x {seq} tokens, {'training' if grad else 'inference'} forward: the hook sequence of a "
          f"meta-device forward, replayed on uninitialised CPU tensors of the same sizes; the launches' driver "
          f"call stubbed (launch path: {triton_backend.launch_path()} here; counted launches below)"
          f"{'; new activations at every forward' if args.fresh_activations else ''}", flush=True)
    events, ops = record(meta_model, forward)
    model = gpt2_small(layers, "meta", torch.bfloat16).to_empty(device="cpu")  # virtual memory only
    events = materialize(events, requires_grad=grad)
    hooks = sum(1 for event in events if event[0] == "post")

    def run():
        replay(model, fresh_activations(events) if args.fresh_activations else events, grad=grad)

    if args.targets:
        with triton_on_cpu():
            times = measure(model, run, TARGETS, args.repeats, args.inner, clock=time.thread_time)
        per_hook = {v: (times[v] - times["none"]) / hooks * 1e6 for v in TARGETS}
        floor = per_hook["floor"]
        print(f"targets ({args.repeats} rounds of {args.inner} forwards): floor {floor:.2f} us/hook; "
              f"check='batch' {per_hook['batch']:.2f} us = {per_hook['batch'] / floor:.2f}x; "
              f"watch() {per_hook['watch']:.2f} us = {per_hook['watch'] / floor:.2f}x")
        return None
    with triton_on_cpu():
        times = measure(model, run, VARIANTS, args.repeats, args.inner, clock=time.thread_time)
        counts = {v: counted(model, run, v) for v in DETECTORS}
        prof = profile(model, run, args.profile, args.inner, args.top) if args.profile else None
        collections = {v: collector(model, run, v, args.collector) for v in ("batch", "watch")} if args.collector else None
    none = times["none"]
    per_hook = {v: (times[v] - none) / hooks * 1e6 for v in VARIANTS}
    print(f"{hooks} hooks and {ops} ATen ops per forward; medians of {args.repeats} round-robin rounds of "
          f"{args.inner} replayed forwards, in the replaying thread's CPU time ('none': the replay loop alone, "
          f"{none * 1e3:.2f} ms; torch's own hook-calling path in Module.__call__ is not in the replay)")
    print()
    print("| variant | forward (ms) | host us/hook | launches (through Triton) | uploads | programs | tensors read "
          "| MB read | copies | Python engine calls (us/hook in them) | flush (ms; of it before the host read) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        c = counts.get(v)
        cells = (f"{c['launches']} ({c['ordinary']}) | {c['uploads']} | {c['programs']} | {c['tensors']} | "
                 f"{c['bytes'] / 1e6:.0f} | {c['copies']} | {c['compute_calls']} ({c['compute_s'] / hooks * 1e6:.1f}) | "
                 f"{c['flush_s'] * 1e3:.2f} ({c['flush_before_read_s'] * 1e3:.2f})") if c else " | ".join(["-"] * 9)
        print(f"| {v} | {times[v] * 1e3:.2f} | {per_hook[v]:.1f} | {cells} |")
    for v in VARIANTS:
        csv_rows.append((f"triton host {v}: forward", times[v] * 1e3, "ms"))
        csv_rows.append((f"triton host {v}: host per hook", per_hook[v], "us"))
    for v, c in counts.items():
        for key in ("launches", "ordinary", "uploads", "programs", "tensors", "copies", "compute_calls"):
            csv_rows.append((f"triton host {v}: {key}", c[key], "per forward"))
        csv_rows.append((f"triton host {v}: bytes read", c["bytes"] / 1e6, "MB per forward"))
        csv_rows.append((f"triton host {v}: flush", c["flush_s"] * 1e3, "ms"))
    csv_rows.append(("triton host: hooks", hooks, "per forward"))
    if collections is not None:
        print()
        print(f"== The cyclic collector during {args.collector} forwards in a row (objects the collector tracks in "
              f"this process: {len(gc.get_objects())}); per generation: collections, ms per forward in them")
        print("| variant | generation 0 | generation 1 | generation 2 (full) | ms per forward in all |")
        print("|---|---|---|---|---|")
        for v, generations in collections.items():
            cells = [f"{generations.get(g, (0, 0.0))[0]}, {generations.get(g, (0, 0.0))[1] / args.collector * 1e3:.3f}"
                     for g in range(3)]
            total = sum(seconds for _, seconds in generations.values()) / args.collector * 1e3
            print(f"| {v} | {' | '.join(cells)} | {total:.3f} |")
            csv_rows.append((f"triton host {v}: collector", total, "ms per forward"))
            csv_rows.append((f"triton host {v}: full collections", generations.get(2, (0, 0.0))[0],
                             f"per {args.collector} forwards"))
    if prof is not None:
        print()
        print(f"== cProfile of {args.profile}, {args.inner} forwards ({hooks} hooks each), top {args.top} by tottime")
        print(prof)

    backward = None
    if not args.no_backward:
        print()
        print(f"== watch()'s backward: the same tree ({layers} layers, 12 heads) at small widths (n_embd 96, "
              "vocab 512), fp32, batch 1 x 16, trained on the CPU through the same path, one torch thread; the "
              "host time inside its gradient hooks and its end-of-pass flush", flush=True)
        seconds, bcounts = backward_path(args)
        bhooks = bcounts["hooks"]
        us = seconds / max(bhooks, 1) * 1e6
        print(f"{bhooks} gradient hooks per backward: {seconds * 1e3:.2f} ms in them and the flush that ends the "
              f"pass (median of {args.repeats * args.inner} backwards), {us:.1f} host us/hook; {bcounts['launches']} "
              f"launches ({bcounts['ordinary']} through Triton), {bcounts['uploads']} uploads, {bcounts['copies']} "
              f"copies, flush {bcounts['flush_s'] * 1e3:.2f} ms")
        csv_rows.append(("triton host watch backward: host per hook", us, "us"))
        for key in ("hooks", "launches", "uploads", "copies"):
            csv_rows.append((f"triton host watch backward: {key}", bcounts[key], "per backward"))
        backward = (us, bcounts)

    step = None
    if not args.no_step:
        print()
        print("== check=\"step\": the root's two hooks on the same forward's root call (new activations each "
              "time); at the backward's end every parameter's gradient (GPT-2 small's, bf16) in one engine call; "
              "the root outputs' gradient hooks and the callbacks to the backward's end in a real one-op backward; "
              "medians in the thread's CPU time", flush=True)
        with triton_on_cpu():
            step = step_path(args, model, run, events)
        forward_s, fcounts, backward_s, bcounts, fbytes, bbytes = step
        print("| pass | host us | engine calls | launches | uploads | bytes read (MB) |")
        print("|---|---|---|---|---|---|")
        print(f"| forward (root outputs) | {forward_s * 1e6:.1f} | {fcounts['compute_calls']} | {fcounts['launches']} "
              f"| {fcounts['uploads']} | {fbytes / 1e6:.0f} |")
        print(f"| backward (every gradient) | {backward_s * 1e6:.1f} | {bcounts['compute_calls']} | "
              f"{bcounts['launches']} | {bcounts['uploads']} | {bbytes / 1e6:.0f} |")
        print(f"host work per healthy step: {(forward_s + backward_s) * 1e6:.1f} us; bytes read per step: "
              f"{(fbytes + bbytes) / 1e6:.0f} MB (the root's outputs and the gradients)")
        csv_rows.append(("triton host step: forward", forward_s * 1e6, "us"))
        csv_rows.append(("triton host step: backward", backward_s * 1e6, "us"))
        csv_rows.append(("triton host step: per step", (forward_s + backward_s) * 1e6, "us"))
        csv_rows.append(("triton host step: bytes read", (fbytes + bbytes) / 1e6, "MB per step"))

    ops_per_pass = model_ops(layers)
    print()
    gemm_ms, other_ms = gpt2_gpu_model(batch, seq)
    if (layers, batch, seq) != (12, 8, 1024):
        print("   (not the GPT-2-small 12-layer 8 x 1024 sequence: the projection is not meaningful)")
    print(f"== Projection: H200, GPT-2 small bf16. GPU-bound: the measured batch, {STEP_MS:.0f} ms of GPU work per "
          f"step (its model: GEMMs {gemm_ms:.1f} ms at {GEMM_TFLOPS:.0f} TFLOP/s + other ops {other_ms:.1f} ms at "
          f"{HBM_TBPS:.0f} TB/s), forward 1/3. Host-bound: batch {HOST_BOUND[0]} x {HOST_BOUND[1]}, the model's GPU "
          f"time scaled from the same model; the detector's kernels as at the measured batch (an upper bound: "
          f"there the step waits for the host). The model's host work "
          f"{MODEL_OP_HOST_US} us per ATen op: {ops_per_pass[0]} forward, {ops_per_pass[1]} backward, "
          f"{ops_per_pass[2]} fused AdamW (counted on the tree). Detector: this CPU's host figures above, "
          f"{TRITON_LAUNCH_US} us per launch, {UPLOAD_US} us per upload, {ATEN_LAUNCH_US} us per ATen copy, "
          f"{SYNC_US} us per host read; each read's kernels take the longer of its bytes at {HBM_TBPS} TB/s and "
          f"{KERNEL_MIN_US} us per launch. watch() reads its backward's gradients too (check='module', "
          f"'batch' and defer have no backward hooks).")
    gradients = gradient_sizes(model, events)
    if backward is not None:
        print(f"watch()'s backward reads {len(gradients)} gradients of GPT-2 small ({sum(gradients) / 1e6:.0f} MB: "
              f"its parameters and hooked outputs), one launch each")
    results = {}
    print("| regime | variant | step without (ms) | detector host (ms/step) | detector GPU (ms/step) | added (ms) "
          "| overhead |")
    print("|---|---|---|---|---|---|---|")
    for regime in regimes(batch, seq, ops_per_pass):
        for v in ("module", "batch", "watch", "defer"):
            forward_cost = pass_cost(counts[v], hooks, per_hook[v], counts[v]["device_s"] * 1e3)
            if v == "module":
                forward_cost = forward_cost + (hooks,)
            backward_cost = None
            if v == "watch" and backward is not None:
                us, bcounts = backward
                device_ms = sum(max(KERNEL_MIN_US / 1e3, size / (HBM_TBPS * 1e9)) for size in gradients)
                backward_cost = pass_cost(bcounts, bcounts["hooks"], us, device_ms)
            added, overhead = project(regime, "module" if v == "module" else "batch", (forward_cost, backward_cost))
            host_ms = forward_cost[0] + (backward_cost[0] if backward_cost else 0)
            gpu_ms = forward_cost[1] + (backward_cost[1] if backward_cost else 0)
            results[(regime.name, v)] = overhead
            print(f"| {regime.name} | {v} | {regime.baseline:.1f} | {host_ms:.2f} | {gpu_ms:.2f} | {added:+.2f} "
                  f"| {overhead * 100:+.1f}% |")
            csv_rows.append((f"projected H200 step overhead {v} ({regime.name})", overhead * 100, "%"))
        if step is not None:
            forward_s, fcounts, backward_s, bcounts, fbytes, bbytes = step
            passes = tuple(pass_cost(c, 1, s * 1e6, max(KERNEL_MIN_US / 1e3 * max(c["launches"], 1),
                                                        size / (HBM_TBPS * 1e9)))
                           for c, s, size in ((fcounts, forward_s, fbytes), (bcounts, backward_s, bbytes)))
            added, overhead = project(regime, "batch", passes)
            print(f"| {regime.name} | step | {regime.baseline:.1f} | {passes[0][0] + passes[1][0]:.2f} | "
                  f"{passes[0][1] + passes[1][1]:.2f} | {added:+.2f} | {overhead * 100:+.2f}% |")
            csv_rows.append((f"projected H200 step overhead step ({regime.name})", overhead * 100, "%"))
    gpu_bound = regimes(batch, seq, ops_per_pass)[0].name
    return per_hook["batch"], counts["batch"], results[(gpu_bound, "batch")]


def cpu_path(args, csv_rows):
    model = gpt2_small(args.layers, "cpu", torch.float32)
    ids = torch.zeros((1, args.cpu_seq), dtype=torch.long)

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    print()
    print(f"== CPU backend host work: GPT-2 small tree ({args.layers} layers), fp32, CPU, real weights, "
          f"batch 1 x {args.cpu_seq} tokens, no grad, {torch.get_num_threads()} threads: the hook sequence of a "
          f"real forward, replayed on its real tensors, read by the CPU launcher (the C++ kernel)", flush=True)
    events, _ = record(model, forward)
    hooks = sum(1 for event in events if event[0] == "post")

    def run():
        replay(model, events)

    times = measure(model, run, VARIANTS, args.repeats, args.inner)
    launcher = cpu_backend.launcher()
    print(f"{hooks} hooks per forward; medians of {args.repeats} round-robin rounds of {args.inner} replays")
    print()
    print("| variant | forward (ms) | host us/hook | launches in the core's call | tensors read |")
    print("|---|---|---|---|---|")
    none = times["none"]
    for v in VARIANTS:
        per_hook = (times[v] - none) / hooks * 1e6
        cells = "- | -"
        if v in DETECTORS:
            detach = attach(v, model)
            try:
                run()
                before = (launcher.direct_launches, launcher.tensors_read)
                run()
                launches, tensors = launcher.direct_launches - before[0], launcher.tensors_read - before[1]
            finally:
                detach()
            cells = f"{launches} | {tensors}"
            csv_rows.append((f"cpu host {v}: launches", launches, "per forward"))
        print(f"| {v} | {times[v] * 1e3:.2f} | {per_hook:.1f} | {cells} |")
        csv_rows.append((f"cpu host {v}: forward", times[v] * 1e3, "ms"))
        csv_rows.append((f"cpu host {v}: host per hook", per_hook, "us"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smallest mode: 1 layer, batch 1 x 64 tokens, 3 rounds (smoke test; figures not comparable)")
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 small has 12")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--cpu-seq", type=int, default=8, help="tokens of the CPU-backend run (batch 1)")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin rounds")
    parser.add_argument("--inner", type=int, default=None, help="forwards (backwards) timed per round")
    parser.add_argument("--profile", nargs="?", const="batch", choices=DETECTORS, metavar="VARIANT",
                        help="cProfile a variant (default: batch) and print the top costs")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--targets", action="store_true",
                        help="time only the floor, check='batch' and watch() (15 rounds of 20 forwards unless "
                             "--repeats/--inner say otherwise) and print their ratios to the floor")
    parser.add_argument("--collector", type=int, default=None,
                        help="forwards in a row for the cyclic collector's figures of check='batch' and watch() "
                             "(default 2000, 20 with --quick; 0 skips)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU-backend run")
    parser.add_argument("--no-backward", action="store_true", help="skip watch()'s backward (not projected then)")
    parser.add_argument("--no-step", action="store_true", help="skip check=\"step\" (not projected then)")
    parser.add_argument("--no-grad", action="store_true",
                        help="activations as in an inference forward (no grad); by default a training forward, "
                             "as in the step the projection is about")
    parser.add_argument("--fresh-activations", action="store_true",
                        help="new activations at every replayed forward, as training makes them (the same ones by "
                             "default)")
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args(argv)
    quick = args.quick
    args.layers = args.layers or (1 if quick else 12)
    args.batch = args.batch or (1 if quick else 8)
    args.seq = args.seq or (64 if quick else 1024)
    args.repeats = args.repeats or (3 if quick else 15 if args.targets else 7)
    args.inner = args.inner or (1 if quick else 20 if args.targets else 3)
    args.collector = (20 if quick else 2000) if args.collector is None else args.collector
    if triton_common.triton is None:
        raise SystemExit(f"triton is needed for its kernels' constexpr types: {triton_common._IMPORT_ERROR}")
    if triton_common._EXTENSION is None:
        print("the C++ extension is unavailable: the per-hook reads take the Python path (counted launches)")
    print(_results.machine_line(), flush=True)
    csv_rows = []
    measured = host_path(args, csv_rows)
    if measured is None:
        return 0  # --targets
    per_hook, counts, overhead = measured
    if args.no_cpu:
        pass
    elif cpu_backend.unavailable_reason() is not None:
        print(f"\n== CPU backend host work: skipped, the cpu backend is unavailable: {cpu_backend.unavailable_reason()}")
    else:
        cpu_path(args, csv_rows)
    _results.write_rows(args.csv, "host_path", csv_rows)
    print()
    print(f"host us/hook: {per_hook:.1f}; launches/forward: {counts['launches']}; "
          f"uploads/forward: {counts['uploads']}; projected H200 step overhead: {overhead * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
