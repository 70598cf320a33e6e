"""Host work of the GPU path per hook, measured without a GPU.

On a GPU the CPU only issues kernels, so what a hook costs the step is its host work: Python,
dispatch, the Triton backend's tables, launches and uploads. This script runs that host
work for real on the GPT-2-small hook sequence and stubs only what needs a GPU:

- The hook sequence: ``GPT2LMHeadModel`` with GPT-2 small's module tree (12 layers, n_embd 768,
  12 heads, vocab 50257, random weights from a config, nothing downloaded) in bf16 runs one
  forward on the **meta device** with ``input_ids`` of batch 8 x 1024 tokens (``--batch``,
  ``--seq``); every module call (pre and post, args, kwargs, output) is recorded. The calls are
  then **replayed**: each meta tensor becomes an uninitialised CPU tensor of the same shape,
  strides and dtype (``torch.empty_strided``: virtual memory, never written or read), the same
  meta tensor always the same CPU tensor (so the detector's per-forward reuse of rows works as in
  a real run), and the parameters are those of the same model built by ``to_empty(device="cpu")``.
  The replay calls each module's registered hooks as ``Module.__call__`` does (pre hooks, forward
  hooks, with_kwargs honoured) under no_grad: what is timed is the hooks alone, without the
  model's own ops (which on a GPU run on the device) and without torch's hook-calling path in
  ``Module.__call__`` (about 1 us per module; the replay's "noop" row is the Python call alone).
- Dispatch sends these CPU tensors to the ``triton`` backend (``triton_backend.supports`` and
  ``unavailable_reason`` patched, ``dispatch._PREFERRED["cpu"] = "triton"``, as under
  ``TRITON_INTERPRET=1``); its ``compute()`` runs unchanged: flat sources, the per-tensor table
  (``_table``), the buffer that holds it and the partial rows (``_buffer``: on CPU tensors the
  table is packed straight into it), the constexpr arguments in ``_launch``.
- Stubbed, for the per-hook kernel (``triton_backend.read_into``, one launch per 8 tensors,
  nothing uploaded): only the final driver call, its compiled kernel's ``run`` (counted: launches
  and programs); its first ``_read_kernel[grid](...)`` per variant (Triton's compile) returns a
  stand-in compiled kernel, which every later launch calls directly, as on a GPU.
- Stubbed, for the table kernels (calls the per-hook kernel does not take): the two Triton
  kernels' ``kernel[grid](...)`` calls (counted: launches and programs;
  the combine stub zeroes the rows it would write, about 1 us of host time a real launch does not
  spend), and a non-dense tensor's ``.contiguous()`` copy (counted; a GPU kernel). On CUDA the
  table goes through a pinned staging buffer and one ``copy_(non_blocking=True)``; here (CPU
  tensors) it is packed into the buffer directly: the upload is counted once per ``compute()``
  call and costed in the projection (UPLOAD_US).

Measured per forward, side by side in one process, medians of round-robin runs: no hooks (the
replay loop), a no-op forward hook on every module, a "floor" hook (flatten the call as the
reference does and keep each tensor with its version counter: the least a staging hook does in
Python), check="module", check="batch" and
``watch()`` (forward hooks only: the forward's hook sequence; the replay runs under no_grad, but
the activations require grad as in a training forward unless ``--no-grad``). Host us per hook =
(replay time - no-hook replay time) / hooks. An instrumented extra replay per variant counts
engine calls, launches, uploads, chunks (partials programs), table ints, bytes read and the time inside
``triton_backend.compute`` and in the end-of-forward ``flush``. ``--profile`` adds cProfile's top
functions of check="batch".

The CPU backend's host figures: the same model on CPU, fp32, real weights, one real forward of
batch 1 x 8 tokens (``--cpu-seq``) recorded and replayed on its real tensors with the C++ kernel;
``_C.compute`` is wrapped to count its calls and time them in the same runs, reported apart from
the Python around it.

Then a projection of the added time of one training step on an H200 (``project()``, its model
and constants printed). The last line is, for check="batch":

    host us/hook: X; launches/forward: Y; uploads/forward: Z; projected H200 step overhead: W%

    .venv/bin/python benchmarks/bench_host_path.py [--quick] [--layers N] [--repeats R]
        [--profile] [--no-cpu] [--csv PATH]
"""

import argparse
import contextlib
import ctypes
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import transformers

import overflow_fast
import overflow_fast.hooks.reads
from overflow_fast import DebugUnderflowOverflow
from overflow_fast.hooks.passes import Passes
from overflow_fast.hooks.frames import forward_items
from overflow_fast.stats import cpu_backend, dispatch, triton_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

# -- the projection's model (H200-class GPU, GPT-2 small, bf16) ------------------------------------
GEMM_TFLOPS = 600.0  # dense bf16 GEMMs
HBM_TBPS = 3.0  # achieved memory bandwidth: the model's other ops and the detector's kernels
STEP_MS = 50.0  # one training step of GPT-2 small at 8 x 1024 tokens (forward = 1/3 of it)
# host cost of one launch on the driver (cuLaunchKernel behind a compiled kernel's launcher): 5 us
# until a GPU has measured it (benchmarks/gpu_check.py); the Python before it is measured here
TRITON_LAUNCH_US = 5.0
ATEN_LAUNCH_US = 5.0  # host cost of one ATen CUDA kernel launch (a .contiguous() copy)
UPLOAD_US = 6.0  # pinned staging (caching host allocator) + cudaMemcpyAsync enqueue, per upload
KERNEL_MIN_US = 3.0  # smallest duration of a kernel on the GPU
SYNC_US = 25.0  # one host read: wait for the stream, D2H copy of the rows, wake up
MODEL_OP_HOST_US = 10.0  # the model's own host work per ATen op on a GPU (Python, dispatch, launch)

VARIANTS = ("none", "noop", "floor", "module", "batch", "watch", "defer")
DETECTORS = VARIANTS[3:]


# -- stubs: the GPU-only steps of the Triton path -----------------------------------------------------

class Counters:
    def __init__(self):
        self.reset()

    def reset(self):
        self.compute_calls = 0
        self.tensors = 0
        self.bytes = 0
        self.launches = 0
        self.programs = 0
        self.uploads = 0
        self.table_ints = 0
        self.chunks = 0
        self.copies = 0
        self.copy_bytes = 0
        self.compute_s = 0.0
        self.flush_s = 0.0
        self.flush_before_read_s = 0.0  # of flush_s: before its host read (the final engine call, ...)
        self.kernel_calls = 0  # _C.compute (CPU backend)
        self.kernel_s = 0.0
        self.described = []  # lists of tensors the triton tables describe, summed by settle()

    def settle(self):
        """Add the described tensors to ``tensors`` and ``bytes`` (summed here, not in the timed
        calls: the sums cost more than the C++ table itself)."""
        for tensors in self.described:
            self.tensors += len(tensors)
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.described = []


COUNT = Counters()


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


class _StubCompiled:
    """Stands for the per-hook kernel's compiled kernel: ``run`` is the launcher's driver call,
    counted; everything before it (the arguments, the stream's accumulators) runs for real. It
    zeroes the rows the kernel would write (finite, nothing detected; well under 1 us)."""

    function = 0
    packed_metadata = None

    @staticmethod
    def launch(grid, out, slots):
        COUNT.launches += 1
        COUNT.programs += grid
        ctypes.memset(out, 0, 64 * slots)

    def run(self, grid, _y, _z, _stream, _function, _metadata, _launch_metadata, _enter, _exit, out, *args):
        self.launch(grid, out, _used_slots(args[1:]))  # args[0]: the accumulators


def _used_slots(slots):
    """The slots a launch fills (its rows), from its (address, numel, word) per slot (an unused one
    has numel -1), then the constexprs."""
    numels = slots[1:3 * triton_backend.MAX_SLOTS:3]
    return sum(1 for numel in numels if numel != -1)


class _StubReadKernel:
    """``_read_kernel[grid](...)``, Triton's ordinary call of the per-hook kernel, which compiles
    it and returns the compiled kernel (then called directly): counted, a stand-in returned."""

    def __getitem__(self, grid):
        def call(out, *args, K, **kwargs):
            _StubCompiled.launch(grid[0], out, _used_slots(args[1:]))  # args[0]: the accumulators
            return _StubCompiled()
        return call


def _counting_launch(real):
    def launch(buffer, out, num_tensors, num_chunks, *args):
        COUNT.uploads += 1  # on CUDA: one copy from the pinned staging buffer per call (_buffer)
        COUNT.table_ints += 4 * num_tensors + 1  # the table at the start of buffer (_table)
        COUNT.chunks += num_chunks
        return real(buffer, out, num_tensors, num_chunks, *args)
    return launch


def _flat_source(tensor):
    """triton_backend._flat_source, except that the copy of a non-dense tensor (one ATen kernel on
    a GPU) is counted and stands as an uninitialised tensor: its data are never read here."""
    if tensor.is_neg() or tensor.is_contiguous() or triton_backend._is_dense(tensor):
        return triton_backend._REAL_FLAT_SOURCE(tensor)
    COUNT.copies += 1
    COUNT.copy_bytes += tensor.numel() * tensor.element_size()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _counting_table(real):
    """triton_backend._table (the Python table) counting the tensors it describes."""
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


class _NoHooks:
    class runtime:  # noqa: N801 - triton.knobs.runtime's shape
        launch_enter_hook = None


@contextlib.contextmanager
def triton_on_cpu():
    """Route CPU tensors to the triton backend (as under TRITON_INTERPRET=1), its host work real,
    its kernel launches stubbed."""

    def supports(tensor):
        return (tensor.device.type == "cpu" and tensor.dtype in triton_backend.SUPPORTED_DTYPES
                and tensor.layout == torch.strided)

    triton_backend._REAL_FLAT_SOURCE = triton_backend._flat_source
    with contextlib.ExitStack() as stack:
        for obj, name, value in (
            (triton_backend, "supports", supports),
            (triton_backend, "unavailable_reason", lambda: None),
            (triton_backend, "_stats_partials_kernel", _StubKernel("partials")),
            (triton_backend, "_stats_combine_kernel", _StubKernel("combine")),
            (triton_backend, "_read_kernel", _StubReadKernel()),
            (triton_backend, "_DIRECT_REASON", None),  # the launch a CUDA machine makes
            (triton_backend, "_KNOBS", _NoHooks),
            (triton_backend, "_launch", _counting_launch(triton_backend._launch)),
            (triton_backend, "_flat_source", _flat_source),
            (triton_backend, "_table", _counting_table(triton_backend._table)),
            (triton_backend, "scan", _counting_scan(triton_backend.scan)),
            (overflow_fast.hooks.reads, "CPU_AS_DEVICE", True),  # these CPU tensors stand for GPU ones
        ):
            stack.enter_context(patched(obj, name, value))
        preferred = dict(dispatch._PREFERRED)
        dispatch._PREFERRED["cpu"] = "triton"
        dispatch._loaded.pop("triton", None)  # its cached unavailable_reason
        dispatch._choices.clear()
        dispatch._READERS.clear()
        triton_backend.forget_devices()
        try:
            yield
        finally:
            dispatch._PREFERRED.clear()
            dispatch._PREFERRED.update(preferred)
            dispatch._loaded.pop("triton", None)
            dispatch._choices.clear()
            dispatch._READERS.clear()
            triton_backend.forget_devices()


def _timed_cpu_compute(real):
    """The C++ kernel's entry point (``cpu_backend._compute``), counted and timed."""

    def compute(tensors, out):
        start = time.perf_counter()
        result = real(tensors, out)
        COUNT.kernel_s += time.perf_counter() - start
        COUNT.kernel_calls += 1
        COUNT.tensors += len(tensors)
        COUNT.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return result
    return compute


@contextlib.contextmanager
def instrumented():
    """Time spent in triton_backend.compute, in the detector's flush and, of it, before the flush's
    host read (an extra, counted pass)."""
    real_compute = triton_backend.compute
    real_flush = Passes.flush
    real_cpu = torch.Tensor.cpu
    flush_start = [None]  # while a flush runs: when it started, until its first host read

    def cpu(tensor, *args, **kwargs):
        # on a GPU the host read waits for the device: what the flush did before it (engine calls
        # of deferred tensors, the bookkeeping that needs no rows) overlaps the device's work
        if flush_start[0] is not None:
            COUNT.flush_before_read_s += time.perf_counter() - flush_start[0]
            flush_start[0] = None
        return real_cpu(tensor, *args, **kwargs)

    depth = [0]  # compute() runs scan() and compute_scanned(): time the outermost call only

    def timed(real, counts_call):
        def call(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    COUNT.compute_calls += counts_call
                    COUNT.compute_s += time.perf_counter() - start
        return call

    # the backend's work: compute(), or where dispatch builds the table in C++ itself, scan()
    # then compute_scanned() (one engine call)
    compute = timed(real_compute, 1)
    scan = timed(triton_backend.scan, 0)
    compute_scanned = timed(triton_backend.compute_scanned, 1)
    real_read = triton_backend.read_into

    def read_into(tensors, out, *args, **kwargs):  # the per-hook kernel's entry: one engine call
        taken = timed(real_read, 1)(tensors, out, *args, **kwargs)
        if taken:
            COUNT.described.append(tensors)
        else:
            COUNT.compute_calls -= 1  # declined: the call that follows counts
        return taken

    def flush(self, current):
        start = flush_start[0] = time.perf_counter()
        try:
            return real_flush(self, current)
        finally:
            flush_start[0] = None
            COUNT.flush_s += time.perf_counter() - start

    cpu_backend.unavailable_reason()  # loads the extension: its compute is what is timed
    cpu_compute = cpu_backend._compute
    dispatch._READERS.clear()  # the hook layer's cached entry: the timed one from now on
    with patched(triton_backend, "compute", compute), patched(triton_backend, "scan", scan), \
            patched(triton_backend, "read_into", read_into), \
            patched(triton_backend, "compute_scanned", compute_scanned), patched(Passes, "flush", flush), \
            patched(torch.Tensor, "cpu", cpu), \
            patched(cpu_backend, "_compute", _timed_cpu_compute(cpu_compute) if cpu_compute is not None else None):
        try:
            yield
        finally:
            dispatch._READERS.clear()


# -- the model, the recorded hook sequence and its replay ---------------------------------------------

def gpt2_small(layers, device, dtype):
    config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    return model.to(dtype).eval()


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


def materialize(events, empty_on="cpu", requires_grad=False):
    """The events with every meta tensor replaced by an uninitialised CPU tensor of the same size,
    strides and dtype (``torch.empty_strided``: virtual memory only, never written), the same meta
    tensor always by the same CPU tensor, so the detector's reuse of rows works as in a real run.
    ``requires_grad``: floating-point activations require grad, as in a training forward (where
    autograd keeps them until backward, so staging them costs no memory of its own)."""
    memo = {}

    def convert(value):
        if isinstance(value, torch.Tensor):
            if not value.is_meta:
                return value
            key = id(value)
            if key not in memo:
                empty = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=empty_on)
                if requires_grad and empty.is_floating_point():
                    empty.requires_grad_()
                memo[key] = (value, empty)
            return memo[key][1]
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


def replay(model, events):
    """Run the hooks of ``model`` on the recorded calls, as Module.__call__ would (pre hooks when a
    module's forward starts, forward hooks when it ends; with_kwargs honoured), under no_grad."""
    modules = dict(model.named_modules())
    with torch.no_grad():
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
    else:
        raise ValueError(variant)
    return detector.remove


def measure(model, run, variants, repeats, inner, kernel_time=False):
    """Median seconds per replayed forward of each variant (round-robin; hooks attached per round).
    With ``kernel_time``: also the median seconds per forward inside ``_C.compute``, timed in the
    same runs."""
    samples = {v: [] for v in variants}
    kernel = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            detach = attach(variant, model)
            try:
                with instrumented() if kernel_time else contextlib.nullcontext():
                    run()  # warm: lazy buffers, backend choice
                    COUNT.reset()
                    start = time.perf_counter()
                    for _ in range(inner):
                        run()
                    samples[variant].append((time.perf_counter() - start) / inner)
                    kernel[variant].append(COUNT.kernel_s / inner)
            finally:
                detach()
    COUNT.reset()
    medians = {v: statistics.median(s) for v, s in samples.items()}
    if kernel_time:
        return medians, {v: statistics.median(s) for v, s in kernel.items()}
    return medians


TIMED_COUNTERS = ("compute_s", "flush_s", "flush_before_read_s", "kernel_s")


def counted(model, run, variant, passes=7):
    """Instrumented replays of ``variant``: the counters of one, the timed ones the medians of
    ``passes`` replays (a single flush is too short to time alone on a shared machine)."""
    detach = attach(variant, model)
    snapshots = []
    try:
        run()
        with instrumented():
            for _ in range(passes):
                COUNT.reset()
                run()
                COUNT.settle()
                snapshots.append(dict(vars(COUNT)))
    finally:
        detach()
    COUNT.reset()
    snapshot = snapshots[0]
    for name in TIMED_COUNTERS:
        snapshot[name] = statistics.median(s[name] for s in snapshots)
    return snapshot


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


def project(counts, host_per_hook_us, flush_us, hooks, check, base_host_forward_ms, step_ms=STEP_MS,
            host_speedup=1.0, flush_before_read_us=0.0):
    """Added step time (ms) and overhead (fraction) on an H200, from the host figures measured here.

    Timeline model: the GPU runs the step's work (``step_ms``, the forward one third of it) and,
    with a detector, its kernels: every hooked tensor read once at HBM_TBPS (plus copies of
    non-dense tensors, read and written), at least KERNEL_MIN_US per launch. The host issues the
    model's ops (``base_host_forward_ms``) plus, per hook, the detector's Python and table work
    measured here (``host_per_hook_us``), TRITON_LAUNCH_US per launch, UPLOAD_US per upload and
    ATEN_LAUNCH_US per copy, all divided by ``host_speedup`` (a faster host CPU).
    - check="batch": host and GPU overlap within the forward. The host issues the model's ops, the
      hooks' work and, at the end, the flush up to its host read: the engine call over the staged
      tensors and the bookkeeping that needs no rows (``flush_before_read_us``, part of the flush
      measured here); the detector's kernels queue behind the forward's on the
      GPU. Then one sync (SYNC_US) and the rest of the flush (the host read and the replay) run
      with the GPU idle, then one launch's worth of bubble before the backward starts. So the
      forward takes max(host issue, GPU forward) + detector GPU + SYNC_US + the rest of the flush.
      ``host_per_hook_us`` includes the flush (it is the replay's whole time per hook), so the
      flush is taken out of the hooks' share. The backward is untouched (forward hooks only).
    - check="module": every hook syncs, so the GPU idles while the detector's host work runs:
      the forward takes its GPU time plus, per hook, SYNC_US and all of the detector's host work.
    Without a detector the host runs ahead of the GPU (no sync in the step): the step is step_ms
    as long as the model's own host work is shorter than the GPU's.
    """
    forward_gpu = step_ms / 3
    detector_gpu = ((counts["bytes"] + 2 * counts["copy_bytes"]) / (HBM_TBPS * 1e12) * 1e3
                    + (counts["launches"] + counts["copies"]) * KERNEL_MIN_US / 1e3)
    detector_host = (hooks * host_per_hook_us + counts["launches"] * TRITON_LAUNCH_US
                     + counts["uploads"] * UPLOAD_US + counts["copies"] * ATEN_LAUNCH_US) / 1e3 / host_speedup
    base_host = base_host_forward_ms / host_speedup
    baseline = max(step_ms, 3 * base_host)
    if check == "module":
        forward = max(forward_gpu, base_host) + detector_gpu + detector_host + hooks * SYNC_US / 1e3
    else:
        flush = flush_us / 1e3 / host_speedup
        flush_before_read = flush_before_read_us / 1e3 / host_speedup
        issue = base_host + (detector_host - flush) + flush_before_read
        forward = (max(issue, forward_gpu) + detector_gpu + SYNC_US / 1e3 + (flush - flush_before_read)
                   + ATEN_LAUNCH_US / 1e3)
    step = forward + (baseline - max(forward_gpu, base_host))
    return step - baseline, step / baseline - 1, detector_gpu, detector_host


# -- main ----------------------------------------------------------------------------------------

def host_path(args, csv_rows):
    layers, batch, seq = args.layers, args.batch, args.seq
    meta_model = gpt2_small(layers, "meta", torch.bfloat16)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")

    def forward():
        with torch.no_grad():
            meta_model(input_ids=ids)

    print(f"== Triton path host work: GPT-2 small tree ({layers} layers, n_embd 768, 12 heads), bf16, "
          f"batch {batch} x {seq} tokens, activations {'without' if args.no_grad else 'requiring'} grad: the hook "
          f"sequence of a meta-device forward, replayed on "
          f"uninitialised CPU tensors of the same sizes; kernel launches stubbed", flush=True)
    events, ops = record(meta_model, forward)
    model = gpt2_small(layers, "meta", torch.bfloat16).to_empty(device="cpu")  # virtual memory only
    events = materialize(events, requires_grad=not args.no_grad)
    hooks = sum(1 for event in events if event[0] == "post")

    def run():
        replay(model, events)

    with triton_on_cpu():
        times = measure(model, run, VARIANTS, args.repeats, args.inner)
        counts = {v: counted(model, run, v) for v in DETECTORS}
        prof = profile(model, run, "batch", args.inner, args.top) if args.profile else None
    none = times["none"]
    per_hook = {v: (times[v] - none) / hooks * 1e6 for v in VARIANTS}
    base_host_ms = ops * MODEL_OP_HOST_US / 1e3
    print(f"{hooks} hooks and {ops} ATen ops per forward; medians of {args.repeats} round-robin rounds of "
          f"{args.inner} replayed forwards ('none': the replay loop alone, {none * 1e3:.2f} ms; torch's own "
          f"hook-calling path in Module.__call__ is not in the replay)")
    print()
    print("| variant | forward (ms) | host us/hook | engine calls | launches | uploads | chunks "
          "| table ints | tensors read | MB read | copies | us/hook in compute() | flush (ms; of it before the host read) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        c = counts.get(v)
        cells = (f"{c['compute_calls']} | {c['launches']} | {c['uploads']} | {c['chunks']} | {c['table_ints']} | "
                 f"{c['tensors']} | {c['bytes'] / 1e6:.0f} | {c['copies']} | {c['compute_s'] / hooks * 1e6:.1f} | "
                 f"{c['flush_s'] * 1e3:.2f} ({c['flush_before_read_s'] * 1e3:.2f})") if c else " | ".join(["-"] * 10)
        print(f"| {v} | {times[v] * 1e3:.2f} | {per_hook[v]:.1f} | {cells} |")
    for v in VARIANTS:
        csv_rows.append((f"triton host {v}: forward", times[v] * 1e3, "ms"))
        csv_rows.append((f"triton host {v}: host per hook", per_hook[v], "us"))
    for v, c in counts.items():
        for key, unit in (("launches", "per forward"), ("uploads", "per forward"), ("chunks", "per forward"),
                          ("table_ints", "per forward"), ("compute_calls", "per forward")):
            csv_rows.append((f"triton host {v}: {key}", c[key], unit))
        csv_rows.append((f"triton host {v}: compute() per hook", c["compute_s"] / hooks * 1e6, "us"))
        csv_rows.append((f"triton host {v}: flush", c["flush_s"] * 1e3, "ms"))
    csv_rows.append(("triton host: hooks", hooks, "per forward"))

    gemm_ms, other_ms = gpt2_gpu_model(8, 1024)
    print()
    print(f"== Projection: H200, GPT-2 small bf16, 8 x 1024 tokens. Modeled GPU work per step: GEMMs "
          f"{gemm_ms:.1f} ms at {GEMM_TFLOPS:.0f} TFLOP/s + other ops {other_ms:.1f} ms at {HBM_TBPS:.0f} TB/s; "
          f"the step taken as {STEP_MS:.0f} ms (forward 1/3). Host: this CPU's figures (above), "
          f"{TRITON_LAUNCH_US} us per Triton launch, {UPLOAD_US} us per upload, {ATEN_LAUNCH_US} us per ATen "
          f"launch, {SYNC_US} us per host read; the model's own forward issue time {base_host_ms:.1f} ms "
          f"({MODEL_OP_HOST_US} us x {ops} ops).")
    if (layers, batch, seq) != (12, 8, 1024):
        print("   (not the GPT-2-small 12-layer 8 x 1024 sequence: the projection is not meaningful)")
    print("| variant | host CPU | detector host (ms/fwd) | detector GPU (ms/fwd) | added per step (ms) | overhead |")
    print("|---|---|---|---|---|---|")
    results = {}
    for v in ("module", "batch", "watch", "defer"):
        for speedup in (1.0, 1.7):
            added, overhead, det_gpu, det_host = project(
                counts[v], per_hook[v], counts[v]["flush_s"] * 1e6, hooks,
                "module" if v == "module" else "batch", base_host_ms, host_speedup=speedup,
                flush_before_read_us=counts[v]["flush_before_read_s"] * 1e6)
            results[(v, speedup)] = overhead
            label = "this one" if speedup == 1.0 else f"{speedup}x faster"
            print(f"| {v} | {label} | {det_host:.2f} | {det_gpu:.2f} | {added:+.2f} | {overhead * 100:+.1f}% |")
            csv_rows.append((f"projected H200 step overhead {v} (host {speedup}x)", overhead * 100, "%"))
    if prof is not None:
        print()
        print(f"== cProfile of check='batch', {args.inner} forwards ({hooks} hooks each), top {args.top} by tottime")
        print(prof)
    return per_hook["batch"], counts["batch"], results[("batch", 1.0)]


def cpu_path(args, csv_rows):
    model = gpt2_small(args.layers, "cpu", torch.float32)
    ids = torch.zeros((1, args.cpu_seq), dtype=torch.long)

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    print()
    print(f"== CPU backend host work: GPT-2 small tree ({args.layers} layers), fp32, CPU, real weights, "
          f"batch 1 x {args.cpu_seq} tokens, no grad, {torch.get_num_threads()} threads: the hook sequence of a "
          f"real forward, replayed on its real tensors", flush=True)
    events, _ = record(model, forward)
    hooks = sum(1 for event in events if event[0] == "post")

    def run():
        replay(model, events)

    times, kernel_s = measure(model, run, VARIANTS, args.repeats, args.inner, kernel_time=True)
    counts = {v: counted(model, run, v) for v in DETECTORS}
    none = times["none"]
    print(f"{hooks} hooks per forward; medians of {args.repeats} round-robin rounds of {args.inner} replays")
    print()
    print("| variant | forward (ms) | host us/hook | _C.compute calls | us/hook in _C.compute | us/hook Python "
          "| tensors read | MB read | flush (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        per_hook = (times[v] - none) / hooks * 1e6
        c = counts.get(v)
        if c:
            kernel = kernel_s[v] / hooks * 1e6
            cells = (f"{c['kernel_calls']} | {kernel:.1f} | {per_hook - kernel:.1f} | {c['tensors']} | "
                     f"{c['bytes'] / 1e6:.1f} | {c['flush_s'] * 1e3:.2f}")
            csv_rows.append((f"cpu host {v}: _C.compute per hook", kernel, "us"))
            csv_rows.append((f"cpu host {v}: Python per hook", per_hook - kernel, "us"))
            csv_rows.append((f"cpu host {v}: _C.compute calls", c["kernel_calls"], "per forward"))
        else:
            cells = " | ".join(["-"] * 6)
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
    parser.add_argument("--inner", type=int, default=None, help="forwards timed per round")
    parser.add_argument("--profile", action="store_true", help="cProfile check='batch' and print the top costs")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU-backend run")
    parser.add_argument("--no-grad", action="store_true",
                        help="activations as in an inference forward (no grad): staging then reads early once "
                             "stage_bytes of them wait; by default they require grad, as in the training step "
                             "the projection is about")
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args(argv)
    quick = args.quick
    args.layers = args.layers or (1 if quick else 12)
    args.batch = args.batch or (1 if quick else 8)
    args.seq = args.seq or (64 if quick else 1024)
    args.repeats = args.repeats or (3 if quick else 7)
    args.inner = args.inner or (1 if quick else 3)
    if triton_backend.triton is None:
        raise SystemExit(f"triton is needed for its kernels' constexpr types: {triton_backend._IMPORT_ERROR}")
    print(_results.machine_line(), flush=True)
    csv_rows = []
    per_hook, counts, overhead = host_path(args, csv_rows)
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
