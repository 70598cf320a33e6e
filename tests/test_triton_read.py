"""The list kernel (``triton_backend.read_into``, through the device's C++ launcher): how many
launches a call takes, what it declines, that its accumulators are left at identity for the next
launch, its self-check, when its launch is direct (Triton's launch hooks, read from the installed
Triton), and (compiled for sm90 without a GPU) int64 offsets and the metadata the direct launch
needs.

Its exactness over every dtype, special value, size and layout is checked in
test_triton_backend.py, where every case also runs this kernel against the table kernels.
"""

import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from oracle import assert_stats_equal, random_bits, special_values
from overflow_fast.stats import StatsBatch
from overflow_fast.stats.kinds import tensor_device
from overflow_fast.stats import triton_backend as tb
from overflow_fast.stats import triton_common, triton_devices, triton_kernels, triton_launch, triton_list

if tb.unavailable_reason() is not None:
    DEVICE = None
elif triton_common._INTERPRET:
    DEVICE = "cpu"
else:
    DEVICE = "cuda"

needs_backend = pytest.mark.skipif(DEVICE is None, reason=f"triton backend unavailable ({tb.unavailable_reason()})")
SMALL = dict(block_size=16, blocks_per_chunk=2)  # chunks of 32 elements


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


class Launches:
    """Counts ``_list_kernel`` launches (their programs and FORMATS), passing them through."""

    def __init__(self, monkeypatch):
        self.grids = []
        self.formats = []
        kernel = triton_kernels._list_kernel
        launches = self

        class Counting:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.grids.append(grid[0])
                    launches.formats.append(kwargs["FORMATS"])
                    return kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(triton_kernels, "_list_kernel", Counting())


@needs_backend
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 9, 17])
def test_one_launch_per_eight_tensors(monkeypatch, count):
    """A call's tensors take one launch per 8 of them and per group of at most MAX_FORMATS of
    their formats (no compiled variant holds more), each of one program per chunk of each of the 8
    tensors (one for an empty one); nothing else runs."""
    launches = Launches(monkeypatch)
    gen = _gen(count)
    dtypes = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn]
    sizes = [70, 0, 1, 33, 32, 5]
    tensors = [random_bits(dtypes[i % len(dtypes)], (sizes[i % len(sizes)],), gen).to(DEVICE) for i in range(count)]
    rows = torch.full((count, 8), -1, dtype=torch.int64, device=DEVICE)
    assert tb.read_into(tensors, rows, **SMALL)
    programs = [max(-(-t.numel() // 32), 1) for t in tensors]
    want = []
    for begin in range(0, count, 8):
        formats = len({t.dtype for t in tensors[begin:begin + 8]})
        want += [sum(programs[begin:begin + 8])] * -(-formats // triton_common.MAX_FORMATS)
    assert launches.grids == want
    assert all(bin(formats).count("1") <= triton_common.MAX_FORMATS for formats in launches.formats)
    assert_stats_equal(_dicts(rows, tensors), [t.cpu() for t in tensors], f"{count} tensors")


@needs_backend
def test_no_launch_holds_more_formats_than_the_cap(monkeypatch):
    """Eight tensors of eight formats, all starting unaligned, several programs each: two launches
    of four formats, each tensor's row written by the launch holding its format (its partials
    merged there), exact; the table kernels split their partials launches the same way."""
    launches = Launches(monkeypatch)
    gen = _gen(11)
    dtypes = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16, torch.float8_e4m3fn,
              torch.int32, torch.uint8]
    tensors = [random_bits(dtype, (97,), gen).to(DEVICE)[1:] for dtype in dtypes]
    rows = torch.full((8, 8), -1, dtype=torch.int64, device=DEVICE)
    assert tb.read_into(tensors, rows, **SMALL)
    assert len(launches.formats) == 2 and all(bin(f).count("1") == 4 for f in launches.formats)
    assert launches.formats[0] | launches.formats[1] == sum(1 << (triton_common._FORMAT_WORD[d] & 31) for d in dtypes)
    assert_stats_equal(_dicts(rows, tensors), [t.cpu() for t in tensors], "eight formats")
    partials = []
    kernel = triton_kernels._stats_partials_kernel

    class Counting:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                partials.append(kwargs["FORMATS"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "_stats_partials_kernel", Counting())
    assert torch.equal(tb.compute(tensors, block_size=16, blocks_per_chunk=2), rows)
    assert len(partials) == 2 and all(bin(f).count("1") == 4 for f in partials)


@needs_backend
def test_accumulators_are_left_at_identity(monkeypatch):
    """Tensors spanning many programs merge through the stream's accumulators; each launch leaves
    them ready for the next: reading the same tensors again, in another order and beside others,
    gives the same rows."""
    gen = _gen(1)
    big = random_bits(torch.float32, (32 * 9 + 5,), gen).to(DEVICE)
    ints = random_bits(torch.int64, (32 * 4,), gen).to(DEVICE)
    nan = special_values(torch.bfloat16).repeat(7).to(DEVICE)
    first = torch.empty(3, 8, dtype=torch.int64, device=DEVICE)
    assert tb.read_into([big, ints, nan], first, **SMALL)
    assert_stats_equal(_dicts(first, [big, ints, nan]), [big.cpu(), ints.cpu(), nan.cpu()], "first read")
    again = torch.empty(4, 8, dtype=torch.int64, device=DEVICE)
    assert tb.read_into([nan, torch.ones(1, device=DEVICE), big, ints], again, **SMALL)
    assert torch.equal(again[[2, 3, 0]], first)
    state = triton_devices._DEVICES[(torch.device(DEVICE).type, torch.device(DEVICE).index)]
    identity = torch.tensor(triton_launch._IDENTITY_ROW).expand(tb.STREAM_GROUPS * tb.MAX_SLOTS, 8)
    # with the extension SMALL's launcher has accumulators of its own; earlier tests in this process
    # may have left other shapes' launchers, and every one of them must be at identity too
    if triton_common._EXTENSION is not None:
        assert (SMALL["block_size"], SMALL["blocks_per_chunk"]) in state.shapes
    pools = [state.pool] + [pool for _, pool in state.shapes.values()]
    assert all(torch.equal(pool.cpu(), identity) for pool in pools)


@needs_backend
def test_declines_what_it_cannot_take():
    """False, with nothing written, for what the general path must decide: complex, meta or
    other-device tensors, subclasses, more tensors than its launches hold, rows of the wrong
    shape or type, rows inside which a tensor lies."""
    x = torch.arange(6.0, device=DEVICE)
    rows = torch.full((1, 8), -1, dtype=torch.int64, device=DEVICE)

    class Sub(torch.Tensor):
        pass

    for tensors in ([torch.zeros(2, dtype=torch.complex64, device=DEVICE)], [torch.zeros(2, device="meta")],
                    [x.as_subclass(Sub)]):
        assert tb.read_into(tensors, rows) is False
    assert (rows == -1).all()
    many = [x] * (tb.MAX_SLOTS * tb.MAX_READ_LAUNCHES + 1)
    assert tb.read_into(many, torch.empty(len(many), 8, dtype=torch.int64, device=DEVICE)) is False
    assert tb.read_into([x], torch.empty(2, 8, dtype=torch.int64, device=DEVICE)) is False
    assert tb.read_into([x], torch.empty(1, 8, dtype=torch.int32, device=DEVICE)) is False
    assert tb.read_into([x], torch.empty(1, 16, dtype=torch.int64, device=DEVICE)[:, ::2]) is False
    buffer = torch.zeros(3, 8, dtype=torch.int64, device=DEVICE)
    assert tb.read_into([buffer[0, 3:]], buffer[:1]) is False and (buffer == 0).all()
    assert tb.read_into([buffer[2]], buffer[:1])  # the same allocation, not the same memory: read
    assert tb.read_into([], torch.empty(0, 8, dtype=torch.int64, device=DEVICE))


@needs_backend
def test_views_far_into_their_storage_and_copied_layouts():
    """A view starting past element 2**31 of a larger storage (virtual memory, never touched but
    for its few elements), an expanded view (copied flat first), a lazily negated one and an
    unaligned one: the rows the oracle gives."""
    storage = torch.empty(2**31 + 64, dtype=torch.uint8, device=DEVICE) if DEVICE == "cpu" else None
    tensors = []
    if storage is not None:
        far = storage[2**31 + 3:2**31 + 40]
        far.copy_(torch.arange(37, dtype=torch.uint8) * 7)
        tensors.append(far)
        tensors.append(storage[2**31 + 1:2**31 + 40].view(torch.int8)[::2])
    base = random_bits(torch.bfloat16, (5, 9), _gen(2)).to(DEVICE)
    tensors += [base[1].reshape(1, 9).expand(4, 9), base.t(), base.reshape(-1)[1:],
                torch._neg_view(torch.tensor([float("inf"), -1.5, 0.0], device=DEVICE))]
    rows = torch.empty(len(tensors), 8, dtype=torch.int64, device=DEVICE)
    assert tb.read_into(tensors, rows, **SMALL)
    assert_stats_equal(_dicts(rows, tensors), [t.cpu() for t in tensors], "views")


@needs_backend
def test_self_check_passes_and_a_wrong_result_keeps_the_table_kernels():
    """The self-check runs the fixed set through the list read twice against the torch
    backend. A path that gets one count wrong fails it: one warning naming the tensor, and that
    device then declines the list read (its reads go to the table kernels)."""
    device = torch.device(DEVICE)
    tb.forget_devices()
    try:
        assert tb.self_check(device) is None

        state = tb.check_device(device, read=triton_list._read)
        assert state.self_check == "passed" and state.path == tb.LIST

        def off_by_one(tensors, rows):
            triton_list._read(tensors, rows)
            if len(tensors) > 5:  # the first call: tensors[5] of the check's set
                rows[5, 2] += 1  # a nan count

        tb.forget_devices()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = tb.check_device(device, read=off_by_one)
        messages = [str(w.message) for w in caught if "list kernel" in str(w.message)]
        assert len(messages) == 1 and "tensors[5]" in messages[0], messages
        assert state.path == tb.TABLE and state.self_check.startswith("failed: first read: tensors[5]")
        report = tb.device_report()[str(device)]
        assert report[0] == tb.TABLE and report[1].startswith("failed")
        rows = torch.full((1, 8), -1, dtype=torch.int64, device=DEVICE)
        assert tb.read_into([torch.ones(3, device=DEVICE)], rows) is False and (rows == -1).all()

        def raises(tensors, rows):
            raise RuntimeError("simulated launch failure")

        tb.forget_devices()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = tb.check_device(device, read=raises)
        assert state.path == tb.TABLE and "simulated launch failure" in state.self_check
        assert sum("list kernel" in str(w.message) for w in caught) == 1
    finally:
        tb.forget_devices()


needs_extension = pytest.mark.skipif(triton_common._EXTENSION is None, reason="the C++ extension is unavailable")


def test_a_device_is_keyed_in_the_form_its_tensors_report(monkeypatch):
    """``torch.device("cuda")`` names the current CUDA device, whose tensors say "cuda:N"; CPU
    tensors say "cpu" whatever index a caller wrote: every per-device table keys that form."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert tensor_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert tensor_device("cuda") == torch.device("cuda", 1)
    assert tensor_device("cuda:0") == torch.device("cuda", 0)
    assert tensor_device(torch.device("cpu", 0)) == torch.device("cpu") == torch.ones(1).device
    assert tensor_device("cpu") == torch.device("cpu")
    assert tensor_device("meta") == torch.device("meta")
    assert triton_devices.key("cuda") == ("cuda", 1) and triton_devices.key("cpu:0") == ("cpu", None)


@needs_backend
def test_a_device_named_in_another_form_is_the_one_its_tensors_read_on():
    """End to end on the paths this machine runs: a device set up and self-checked under a name its
    tensors do not report (as ``torch.device("cuda")`` on a GPU: here "cpu:0") is the state their
    reads find, the launcher and reader a caller binds for it are that state's, and nothing is set
    up twice."""
    from overflow_fast.stats import dispatch

    if DEVICE != "cpu":
        pytest.skip("the CPU's other form; on a GPU gpu_check's self-check names torch.device('cuda')")
    other = torch.device("cpu", 0)
    tb.forget_devices()
    try:
        state = tb.check_device(other, read=triton_list._read)
        assert state.self_check == "passed" and state.path == tb.LIST, state.self_check
        assert tb.check_device(other).path == tb.LIST  # its own read, through the launcher where there is one
        state = triton_devices.lookup(other)
        x = random_bits(torch.bfloat16, (70,), _gen(4))
        rows = torch.full((1, 8), -1, dtype=torch.int64)
        assert tb.read_into([x], rows) and triton_devices.lookup(x.device) is state
        assert_stats_equal(_dicts(rows, [x]), [x], "read on the device named cpu:0")
        assert list(tb.device_report()) == ["cpu"]
        with dispatch.preferring("cpu", "triton"):
            assert dispatch.rows_reader("triton", other) is tb.read_into
            assert dispatch.rows_launcher("triton", other) is state.launcher
        assert list(tb.device_report()) == ["cpu"]
    finally:
        tb.forget_devices()


@needs_backend
@needs_extension
def test_the_hooks_reads_go_through_the_launcher_s_packing():
    """With the extension, ``read_into`` is the device's C++ launcher: it packs the arguments and,
    where it cannot launch directly (here: the interpreter), hands each launch to Triton's
    ordinary call, arguments and constexprs as the kernel takes them."""
    device = torch.device(DEVICE)
    state = triton_list.device_state(device)
    launcher = state.launcher_for(*SMALL.values())
    before = launcher.ordinary_launches + launcher.direct_launches
    gen = _gen(3)
    tensors = [random_bits(torch.bfloat16, (70,), gen).to(DEVICE), torch.zeros(0, device=DEVICE),
               random_bits(torch.int64, (5,), gen).to(DEVICE)]
    rows = torch.full((3, 8), -1, dtype=torch.int64, device=DEVICE)
    assert tb.read_into(tensors, rows, **SMALL)
    assert launcher.ordinary_launches + launcher.direct_launches == before + 1
    assert launcher.programs >= 3 + 1 + 1
    assert_stats_equal(_dicts(rows, tensors), [t.cpu() for t in tensors], "through the launcher")
    assert tb.launch_path(state).startswith("ordinary (") or DEVICE == "cuda"


def _count_launcher(ordinary, runtime=None, kernel=None):
    """A launcher with the benchmark's counting driver (the stand-in for the GPU's: it launches
    nothing and writes zero rows), reading ``runtime``'s launch hooks (default Triton's)."""
    pool = torch.tensor(triton_launch._IDENTITY_ROW).repeat(tb.STREAM_GROUPS * tb.MAX_SLOTS, 1)
    hooks = lambda: triton_launch.launch_hooks(runtime, kernel)  # noqa: E731
    return triton_common._EXTENSION.Launcher("count", torch.device("cpu"), triton_common._PLAIN_TYPES,
                                             triton_common._FORMAT_WORD, triton_common._ALIGNED_BIT,
                                             tb.BLOCK_SIZE * tb.BLOCKS_PER_CHUNK, tb.MAX_READ_LAUNCHES,
                                             triton_common.MAX_FORMATS, pool, tb.STREAM_GROUPS, hooks(), hooks, True,
                                             ordinary)


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
@needs_extension
def test_the_launch_hooks_predicate_reads_the_installed_triton():
    """Triton's launch hooks decide each launch: none registered (the installed Triton's empty
    HookChain) means direct; one added to the chain, or a kernel's pre-run hook, or a chain
    replaced by a hook of its own, means Triton's own launch, which calls it. Decided by the
    launcher's real predicate on the real knobs (the benchmark's counting driver stands for the
    GPU); ``overflow-fast info`` reads the same predicate."""
    from triton import knobs

    runtime = knobs.runtime
    assert type(runtime.launch_enter_hook).__name__ == "HookChain"  # never None in this Triton
    calls = []

    def ordinary(grid, args, slots, formats, any_unaligned):
        calls.append((grid, len(args), slots, formats, any_unaligned))

    launcher = _count_launcher(ordinary)
    x = torch.ones(3, dtype=torch.bfloat16)
    rows = torch.full((1, 8), -1, dtype=torch.int64)

    def path():
        launched = launcher.direct_launches, len(calls)
        assert launcher.read([x], rows)
        reason = triton_launch.hooks_reason()
        assert launcher.hooks_reason() == reason
        took = "direct" if launcher.direct_launches > launched[0] else "ordinary"
        assert (took == "direct") == (reason is None), (took, reason)
        return took

    assert path() == "direct" and (rows == 0).all()  # the counting driver's zero rows

    def hook(metadata):
        pass

    runtime.launch_enter_hook.add(hook)
    try:
        assert path() == "ordinary" and calls[-1][1:] == (2 + 3 * tb.MAX_SLOTS, 1, 1 << 3, False)
    finally:
        runtime.launch_enter_hook.remove(hook)
    assert path() == "direct"
    runtime.launch_exit_hook.add(hook)
    try:
        assert path() == "ordinary"
    finally:
        runtime.launch_exit_hook.remove(hook)
    triton_kernels._list_kernel.add_pre_run_hook(hook)
    try:
        assert path() == "ordinary"
    finally:
        triton_kernels._list_kernel.pre_run_hooks.remove(hook)
    assert path() == "direct"
    with runtime.scope():  # a chain replaced by a plain hook, the earlier Tritons' way
        runtime.launch_enter_hook = hook
        assert path() == "ordinary"
    assert path() == "direct"


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
@needs_extension
def test_a_launch_reads_no_python_attribute():
    """The launch hooks reach the launcher as plain data (the lists hooks are added to, the size of
    the dict that holds the chains): a launch reads no attribute of Triton's objects, yet sees a
    hook added at once, and a chain replaced."""
    from triton import knobs

    reads = []

    class Runtime:  # shaped as Triton's: the chains on the class, an instance that may replace them
        launch_enter_hook = knobs.HookChain()
        launch_exit_hook = knobs.HookChain(reversed=True)

        def __getattribute__(self, name):
            reads.append(name)
            return object.__getattribute__(self, name)

    runtime = Runtime()
    launcher = _count_launcher(lambda *args: None, runtime)
    x, rows = torch.ones(3), torch.empty(1, 8, dtype=torch.int64)
    reads.clear()
    for _ in range(3):
        assert launcher.read([x], rows)
    assert reads == [] and launcher.direct_launches == 3 and launcher.hooks_reason() is None
    object.__getattribute__(runtime, "launch_exit_hook").add(print)
    assert launcher.read([x], rows) and launcher.direct_launches == 3 and reads == []
    object.__getattribute__(runtime, "launch_exit_hook").remove(print)
    assert launcher.read([x], rows) and launcher.direct_launches == 4
    object.__getattribute__(runtime, "__dict__")["launch_enter_hook"] = print  # replaced, not added to
    assert launcher.read([x], rows) and launcher.direct_launches == 4
    assert "a Triton launch hook is set" in launcher.hooks_reason()
    del object.__getattribute__(runtime, "__dict__")["launch_enter_hook"]
    assert launcher.read([x], rows) and launcher.direct_launches == 5


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
@needs_extension
def test_the_launch_hooks_predicate_reads_the_older_tritons_form():
    """Triton 3.3 and older keep a launch hook as the attribute itself (a callable, or None for none),
    where newer ones keep a HookChain: the predicate reads both. The installed Triton has only the
    chain, so the older form is an object of that shape: the launcher is not involved."""
    from triton import knobs

    def hook(metadata):
        pass

    class OlderRuntime:
        launch_enter_hook = hook
        launch_exit_hook = None

    kernel = triton_kernels._list_kernel
    reason = triton_common._EXTENSION.launch_hooks_reason
    assert reason(triton_launch.launch_hooks(OlderRuntime, kernel)) is not None
    OlderRuntime.launch_enter_hook = None
    assert reason(triton_launch.launch_hooks(OlderRuntime, kernel)) is None
    assert reason(triton_launch.launch_hooks(knobs.runtime, kernel)) is None  # the installed one


@pytest.mark.skipif(not torch.cuda.is_available() or tb.unavailable_reason() is not None, reason="needs a CUDA device")
@pytest.mark.parametrize("direct", ["1", "0"], ids=["as decided", "every launch Triton's"])
def test_every_launch_takes_its_device_and_its_stream_s_accumulators(monkeypatch, direct):
    """Whatever the launch (direct, or Triton's own with OVERFLOW_FAST_DIRECT_LAUNCH=0): tensors on
    the last CUDA device read while another is current, and two streams reading tensors that span
    many programs (merged through their stream's accumulators) at once, give the oracle's rows."""
    monkeypatch.setenv("OVERFLOW_FAST_DIRECT_LAUNCH", direct)
    tb.forget_devices()
    try:
        device = torch.device("cuda", torch.cuda.device_count() - 1)
        gen = _gen(21)
        big = [random_bits(torch.bfloat16, (3 * tb.BLOCK_SIZE * tb.BLOCKS_PER_CHUNK + 5,), gen) for _ in range(2)]
        on_device = [t.to(device) for t in big]
        with torch.cuda.device(0):
            rows = torch.full((2, 8), -1, dtype=torch.int64, device=device)
            assert tb.read_into(on_device, rows)
            assert_stats_equal(_dicts(rows, on_device), big, "on the last device")
        streams = [torch.cuda.Stream(device) for _ in range(2)]
        outs = [torch.full((1, 8), -1, dtype=torch.int64, device=device) for _ in streams]
        torch.cuda.synchronize(device)
        for _ in range(20):
            for stream, tensor, out in zip(streams, on_device, outs):
                with torch.cuda.stream(stream):
                    assert tb.read_into([tensor], out)
        torch.cuda.synchronize(device)
        for tensor, out, host in zip(on_device, outs, big):
            assert_stats_equal(_dicts(out, [tensor]), [host], "two streams at once")
    finally:
        tb.forget_devices()


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
def test_a_cuda_device_launches_directly_unless_told_not_to(monkeypatch):
    """Compiled kernels (no interpreter) on a CUDA device take the cuda driver with the installed
    Triton's knobs; OVERFLOW_FAST_DIRECT_LAUNCH=0 keeps every launch Triton's, and says so."""
    monkeypatch.setattr(triton_common, "_INTERPRET", False)  # as on a GPU machine: the kernels compiled
    cuda = torch.device("cuda", 0)
    if triton_common._EXTENSION is None:
        assert triton_launch._launcher_driver(cuda) == (None, "the C++ extension is unavailable")
        return
    assert triton_launch._launcher_driver(cuda) == ("cuda", None)
    assert triton_launch._launcher_driver(torch.device("cpu")) == ("ordinary", "no direct launch on cpu")
    monkeypatch.setenv("OVERFLOW_FAST_DIRECT_LAUNCH", "0")
    assert triton_launch._launcher_driver(cuda) == ("ordinary", "OVERFLOW_FAST_DIRECT_LAUNCH=0")


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
def test_info_s_launch_line_is_the_path_taken():
    """Before any device is used, ``launch_path`` says why this machine launches through Triton
    (here: the interpreter, or no CUDA device), never "direct" where no direct launch can run."""
    path = tb.launch_path()
    if triton_common._EXTENSION is None:
        assert path == "ordinary (the C++ extension is unavailable)"
    elif triton_common._INTERPRET:
        assert path == "ordinary (the interpreter runs the kernels (TRITON_INTERPRET=1))"
    elif not torch.cuda.is_available():
        assert path == "ordinary (no direct launch on cpu)"
    else:
        assert path.startswith(tb.DIRECT) or path.startswith("ordinary (")


_COMPILE_CHILD = r'''
import re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from overflow_fast.stats import triton_backend as tb, triton_common, triton_kernels
assert not triton_common._INTERPRET
names = list(__import__("inspect").signature(triton_kernels._list_kernel.fn).parameters)
code = triton_common._FORMAT_WORD[__import__("torch").bfloat16] & triton_common._CODE_MASK
constexprs = dict(K=8, FORMATS=1 << code, ANY_UNALIGNED=True, BLOCK_SIZE=tb.BLOCK_SIZE,
                  BLOCKS_PER_CHUNK=tb.BLOCKS_PER_CHUNK)
signature = {name: ("constexpr" if name in constexprs else "i64") for name in names}
kernel = triton.compile(ASTSource(triton_kernels._list_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": tb.NUM_WARPS, **triton_common._REGISTER_CAP})
ttir = kernel.asm["ttir"]
offsets = re.findall(r"tt\.addptr[^\n]*:\s*tensor<\d+x!tt\.ptr<[^>]+>>,\s*tensor<\d+x(i\d+)", ttir)
assert offsets and set(offsets) == {"i64"}, set(offsets)
ptx = kernel.asm["ptx"]
assert re.search(r"atom\.[\w.]*acq_rel[\w.]*\.add", ptx), "no acquire-release counter"
atomics = [line.strip() for line in ptx.splitlines() if re.search(r"\b(atom|red)\.global", line)]
# each scalar atomic is issued once per program: by one thread, under one predicate
assert atomics and len({line.split()[0] for line in atomics}) == 1 and atomics[0].startswith("@%p"), atomics
# what the direct launch passes is what this Triton compiled: 26 int64 then two scratch pointers,
# no scratch memory, one CTA, no cooperative or PDL launch
assert tb.metadata_mismatch(kernel) is None, tb.metadata_mismatch(kernel)
params = tb.ptx_parameters(ptx, kernel.metadata.name)
assert len(params) == 28 and params[26].startswith(".u64 .ptr"), params
one = triton.compile(ASTSource(triton_kernels._list_kernel, signature, dict(constexprs, K=1, ANY_UNALIGNED=False)),
                     target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": tb.NUM_WARPS, **triton_common._REGISTER_CAP})
assert tb.metadata_mismatch(one) is None, tb.metadata_mismatch(one)  # unused slots stay parameters
pdl = triton.compile(ASTSource(triton_kernels._list_kernel, signature, dict(constexprs, K=1, ANY_UNALIGNED=False)),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": tb.NUM_WARPS, "launch_pdl": True})
assert "launch_pdl=True" in tb.metadata_mismatch(pdl), tb.metadata_mismatch(pdl)
assert tb.direct_mismatch(one) == "no CUfunction: not a compiled CUDA kernel"  # not loaded: no GPU here
print("COMPILED", len(offsets), ptx.count("atom."))
'''


@pytest.mark.skipif(triton_common.triton is None, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_compiles_for_sm90_with_int64_offsets_and_an_acq_rel_counter():
    """Compiled for an H100-class target (no GPU needed): every pointer offset of the per-hook
    kernel's loads is int64 (so tensors over 2**31 elements cannot wrap); the counter that finds
    the last program is an acquire-release atomic, and every merge is issued by one thread of a
    program (the interpreter runs programs one at a time and cannot show either). Its metadata and
    PTX entry are what the direct launch passes, for every slot variant; a PDL launch is refused."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE_CHILD)], env=env, capture_output=True,
                          text=True, timeout=600)
    if "FileNotFoundError" in proc.stderr and "ptxas" in proc.stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@needs_backend
def test_info_names_each_devices_path_self_check_and_launch():
    """``overflow-fast info`` says which path each device used runs, its self-check and how the
    kernel is launched (here: the interpreter, so the ordinary call)."""
    import importlib

    info = importlib.import_module("overflow_fast.info")

    tb.forget_devices()
    try:
        assert "on first use" in "\n".join(info.lines(info.info()))
        rows = torch.empty(1, 8, dtype=torch.int64, device=DEVICE)
        assert tb.read_into([torch.ones(3, device=DEVICE)], rows)
        lines = [line for line in info.lines(info.info()) if line.startswith("per-hook read")]
        assert len(lines) == 1 and f"({torch.device(DEVICE)}): list kernel; self-check" in lines[0], lines
        assert "launch ordinary (" in lines[0] if DEVICE == "cpu" else "launch direct" in lines[0]
    finally:
        tb.forget_devices()
