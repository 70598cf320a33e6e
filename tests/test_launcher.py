"""The per-hook launcher (csrc/table.cpp): one C++ loop checks a call's tensors and packs them as the
per-hook kernel's arguments, then a driver launches them. On the CPU its driver is the C++ kernel
run on the packed arguments (the cpu backend's per-hook read), so the packing is checked here
against the float64 oracle, bit for bit; a hook's C++ core (HookCore) with a launcher bound reads
a call's tensors in the same call. What it declines, it leaves untouched for Python's general
path; a launcher that fails says so once (its answer, then its disabled reason) and declines from then on.

The CUDA driver (cuLaunchKernel) needs a GPU: its predicate and packing are the same code
(test_triton_list.py reads the predicate with the benchmark's counting driver, and the per-hook
kernel through the interpreter takes this packing); its driver call is measured on a lent GPU only.
"""

import pytest
import torch

from oracle import ALL_DTYPES, assert_stats_equal, random_bits, special_values
from overflow_fast.stats import StatsBatch, cpu_backend
from overflow_fast.hooks.hook_core import LAUNCH_FAILED, LAUNCHED, READ_BY_CALLER

C = cpu_backend.extension()
pytestmark = pytest.mark.skipif(C is None, reason=f"the C++ extension is unavailable ({cpu_backend.unavailable_reason()})")

DTYPES = [dtype for dtype in ALL_DTYPES if dtype in cpu_backend.SUPPORTED_DTYPES]


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


def _read(tensors):
    """The CPU launcher's rows of ``tensors`` (and the launches it made)."""
    launcher = cpu_backend.launcher()
    before = launcher.direct_launches
    rows = torch.full((len(tensors), 8), -1, dtype=torch.int64)
    assert launcher.read(tensors, rows)
    return rows, launcher.direct_launches - before


def _layouts(dtype, gen):
    """A dtype's tensors in every layout a hook meets: contiguous, special values, empty, 0-dim, a
    transposed (dense) view, an unaligned view, a gapped slice and an expanded view (read through a
    flat copy), and for floats a lazily negated view."""
    base = random_bits(dtype, (6, 10), gen)
    tensors = [random_bits(dtype, (37,), gen), special_values(dtype), torch.empty(0, dtype=dtype),
               random_bits(dtype, (), gen), base.t(), base.reshape(-1)[1:], base[:, 1:7], base[1].expand(3, 10)]
    if (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize > 1:  # torch negates no float8
        tensors.append(torch._neg_view(special_values(dtype)))
    return tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_launcher_reads_every_dtype_and_layout_as_the_oracle(dtype):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype))
    tensors = _layouts(dtype, gen)
    rows, launches = _read(tensors)
    assert launches == -(-len(tensors) // 8)
    assert_stats_equal(_dicts(rows, tensors), tensors, str(dtype))


def test_one_launch_per_eight_tensors_of_any_mix_and_the_packing_of_each_slot():
    """Up to 32 tensors of mixed dtypes take one launch per 8; each slot's row is its tensor's,
    whatever its position (a wrong address, numel or format word in any slot shows)."""
    gen = torch.Generator().manual_seed(7)
    for count in (1, 2, 3, 8, 9, 17, 32):
        tensors = [random_bits(DTYPES[(i * 5) % len(DTYPES)], (1 + (i * 13) % 50,), gen) for i in range(count)]
        rows, launches = _read(tensors)
        assert launches == -(-count // 8), count
        assert_stats_equal(_dicts(rows, tensors), tensors, f"{count} tensors")


def test_a_launcher_takes_its_device_only_in_the_form_its_tensors_report():
    """A launcher compares each tensor's device with its own: one named "cpu:0" (or "cuda" without
    an index) would take no tensor, so it is refused where it is made (the engine names devices as
    their tensors do where they enter it: kinds.tensor_device)."""
    from overflow_fast.stats import triton_common, triton_launch

    pool = torch.tensor(triton_launch._IDENTITY_ROW).repeat(8, 1)
    for device in (torch.device("cpu", 0), torch.device("cuda")):
        with pytest.raises(RuntimeError, match="named as its tensors report it"):
            C.Launcher("ordinary", device, triton_common._PLAIN_TYPES, triton_common._FORMAT_WORD,
                       triton_common._ALIGNED_BIT, 1024, 4, 4, pool, 1, None, None, True, None)


def test_it_declines_what_it_cannot_take_and_writes_nothing():
    """False with the rows untouched: a subclass, a meta or sparse tensor, more than 32 tensors,
    ``out`` overlapping a tensor, and tensors whose memory is gone (a freed storage, a view past
    the end of a shrunk one): those must never reach a kernel."""
    launcher = cpu_backend.launcher()

    class Sub(torch.Tensor):
        pass

    x = torch.arange(6.0)
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)
    shrunk_base = torch.ones(64)
    past_end = shrunk_base[40:48]
    shrunk_base.untyped_storage().resize_(16)
    refused = ([x.as_subclass(Sub)], [torch.zeros(2, device="meta")], [torch.ones(3).to_sparse()],
               [x] * 33, [freed], [x, past_end])
    for tensors in refused:
        rows = torch.full((len(tensors), 8), -1, dtype=torch.int64)
        before = launcher.direct_launches
        assert launcher.read(tensors, rows) is False, tensors
        assert (rows == -1).all() and launcher.direct_launches == before
    # a float8 lazy negation: torch has no negation to copy it with (the general path reads it)
    negated = torch._neg_view(special_values(torch.float8_e4m3fn))
    rows = torch.full((2, 8), -1, dtype=torch.int64)
    assert launcher.read([x, negated], rows) is False and (rows == -1).all()
    buffer = torch.zeros(3, 8, dtype=torch.int64)
    assert launcher.read([buffer[0, 3:]], buffer[:1]) is False and (buffer == 0).all()
    assert launcher.read([buffer[2]], buffer[:1])  # the same allocation, not the same memory: read
    assert launcher.read([x], torch.empty(2, 8, dtype=torch.int64)) is False  # out of the wrong shape
    assert launcher.read([], torch.empty(0, 8, dtype=torch.int64))


def test_it_declines_a_released_zero3_parameter_and_reads_other_empty_tensors(monkeypatch):
    """Where DeepSpeed is loaded, an empty tensor is asked of stats.kinds.is_zero3_released (the
    test's one owner): a released parameter's values live in its partitions, which the general path
    reads; any other empty tensor is read here."""
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("deepspeed") or type(sys)("deepspeed"))
    launcher = cpu_backend.launcher()
    released = torch.nn.Parameter(torch.ones(0))
    released.ds_tensor, released.ds_numel = torch.full((4,), 2.0), 4
    rows = torch.full((2, 8), -1, dtype=torch.int64)
    assert launcher.read([torch.ones(3), released], rows) is False and (rows == -1).all()
    assert launcher.read([torch.ones(3), torch.ones(0)], rows)
    assert rows[1].tolist() == [0] * 8


def _bound(capacity=16, stage_bytes=0):
    core = C.hooks.HookCore(capacity, stage_bytes, 1 << 16)
    x = torch.ones(1)
    key = core.add([x], -1, False)[0]  # the device's key, as the detector's first call makes it
    buffer = torch.full((capacity, 8), -1, dtype=torch.int64)
    core.reset()
    return core, key, buffer


def test_a_bound_core_reads_a_call_in_the_same_call():
    """Once bound, the core reads a call's tensors into its rows of the buffer itself, reused rows
    included, and its answer says so (LAUNCHED); what the launcher declines is the caller's to read
    (READ_BY_CALLER), as without a launcher."""
    core, key, buffer = _bound()
    core.bind(key, cpu_backend.launcher(), buffer)
    gen = torch.Generator().manual_seed(3)
    a, b = random_bits(torch.float32, (50,), gen), special_values(torch.bfloat16)
    key, rows, first, to_read, changed, read = core.add([a, b], -1, False)
    assert (rows, first, to_read, changed, read) == ((0, 1), 0, [a, b], [], LAUNCHED)
    c = random_bits(torch.int64, (9,), gen)
    assert core.add([b, c], -1, False)[1:] == ((1, 2), 2, [c], [], LAUNCHED)  # b keeps its row
    assert_stats_equal(_dicts(buffer[:3], [a, b, c]), [a, b, c], "bound")

    class Sub(torch.Tensor):
        pass

    d = torch.ones(2).as_subclass(Sub)
    assert core.add([d, a], -1, False)[1:] == ((3, 0), 3, [d], [], READ_BY_CALLER)  # declined
    assert (buffer[3] == -1).all()
    core.bind(key, None, buffer)
    e = torch.ones(3)
    assert core.add([e], -1, False)[3:] == ([e], [], READ_BY_CALLER)  # unbound: the caller's again


def test_a_bound_core_reads_what_waited_and_what_changed():
    """Deferred tensors are read by the bound launcher when the pass's pending rows are taken; a
    tensor changed after its hook is read as an empty stand-in and its row reported changed."""
    core, key, buffer = _bound(stage_bytes=1 << 20)
    core.bind(key, cpu_backend.launcher(), buffer)
    w, x = torch.ones(4, requires_grad=True), torch.full((3,), 2.0)
    for _ in range(2):  # first pass: watched (read at once); then the site waits
        core.add([w, x], 5, True)
        core.pending()
        core.reset()
    assert core.add([w, x], 5, True)[3] == []  # both wait
    x.add_(1)  # after its hook, before its read
    ((pending_key, first, to_read, changed, read),) = core.pending()
    assert (pending_key, first, to_read[0], changed, read) == (key, 0, w, [1], LAUNCHED)
    assert to_read[1].numel() == 0  # the stand-in
    assert_stats_equal(_dicts(buffer[:1], [w]), [w], "deferred")
    assert buffer[1].tolist() == [0] * 8  # the stand-in: an empty tensor's row


def test_a_launcher_that_fails_says_so_once_and_declines_from_then_on():
    """A launch that raises (here Triton's ordinary launch, the callback) disables the launcher with
    its reason: that call's answer says LAUNCH_FAILED (once), and the next calls' tensors are the
    caller's to read, as the launcher declines them. An interrupt is not a failure: it goes through."""
    from overflow_fast.stats import triton_backend as tb
    from overflow_fast.stats import triton_common, triton_launch

    def failing(*args):
        raise RuntimeError("compiler exploded\nsecond line")

    def interrupted(*args):
        raise KeyboardInterrupt

    def launcher(callback):
        pool = torch.tensor(triton_launch._IDENTITY_ROW).repeat(tb.STREAM_GROUPS * tb.MAX_SLOTS, 1)
        return C.Launcher("ordinary", torch.device("cpu"), triton_common._PLAIN_TYPES, triton_common._FORMAT_WORD,
                          triton_common._ALIGNED_BIT, tb.BLOCK_SIZE * tb.BLOCKS_PER_CHUNK, tb.MAX_READ_LAUNCHES,
                          triton_common.MAX_FORMATS, pool, tb.STREAM_GROUPS, None, None, True, callback)

    core, key, buffer = _bound()
    broken = launcher(failing)
    core.bind(key, broken, buffer)
    x, y = torch.ones(2), torch.ones(3)
    assert core.add([x], -1, False)[3:] == ([x], [], LAUNCH_FAILED)
    assert broken.disabled == "RuntimeError: compiler exploded"
    assert core.add([y], -1, False)[3:] == ([y], [], READ_BY_CALLER)  # said once; declined from now on
    assert broken.read([y], torch.empty(1, 8, dtype=torch.int64)) is False  # disabled
    core.bind(key, launcher(failing), buffer)  # a new one binds in its place
    core, key, buffer = _bound()
    core.bind(key, launcher(interrupted), buffer)
    with pytest.raises(KeyboardInterrupt):
        core.add([y], -1, False)
