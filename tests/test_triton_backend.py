"""The Triton backend against the float64 oracle and the torch backend, bit for bit.

Where CUDA is present the kernels run compiled on CUDA tensors. Without CUDA they run through
Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1 before the backend is
imported). Without Triton everything skips except the check that the package imports and falls
back.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from oracle import ALL_DTYPES, E8M0, assert_stats_equal, has_inf, random_bits, same_stats, special_values
from overflow_fast import tensor_stats
from overflow_fast.stats import StatsBatch, dispatch
from overflow_fast.stats import triton_backend as tb
from overflow_fast.stats import triton_common, triton_devices, triton_kernels, triton_list, triton_table

if tb.unavailable_reason() is not None:
    DEVICE = None
elif triton_common._INTERPRET:
    DEVICE = "cpu"
else:
    DEVICE = "cuda"

needs_backend = pytest.mark.skipif(
    DEVICE is None, reason=f"triton backend unavailable here ({tb.unavailable_reason()})"
)

DTYPES = [d for d in ALL_DTYPES if not d.is_complex]
# Small launch shape: chunks of 32 elements, so tensors of a few dozen elements span several
# chunks and the binary search over the chunk prefix sums crosses tensor boundaries.
SMALL = dict(block_size=16, blocks_per_chunk=2)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rows_to_dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


def _read_rows(tensors, **launch):
    """The list kernel's rows (``read_into``), written over rows of -1; several launches when
    there are more tensors than its largest variant holds."""
    rows = torch.full((len(tensors), 8), -1, dtype=torch.int64, device=DEVICE)
    assert tb.read_into(tensors, rows, **launch)
    return rows


def _check(tensors, label, **launch):
    """Triton rows equal the oracle and the torch backend, through compute() (the table kernels)
    and tensor_stats(); the list kernel's rows equal the table kernels' bit for bit."""
    tensors = [t.to(DEVICE) for t in tensors]
    want_torch = tensor_stats(tensors, backend="torch").tolist()
    table_rows = tb.compute(tensors, **launch)
    if len(tensors) <= tb.MAX_SLOTS * tb.MAX_READ_LAUNCHES:
        read_rows = _read_rows(tensors, **launch)
        assert torch.equal(read_rows, table_rows), f"{label}: list kernel {read_rows} != table kernels {table_rows}"
    got = _rows_to_dicts(table_rows, tensors)
    assert_stats_equal(got, [t.cpu() for t in tensors], label)
    for i, (g, w) in enumerate(zip(got, want_torch)):
        assert same_stats(g, w), f"{label} tensor {i} ({tensors[i].dtype}): triton {g}, torch backend {w}"
    if not launch:
        assert tensor_stats(tensors, backend="triton").values.device.type == DEVICE
        dispatched = tensor_stats(tensors, backend="triton").tolist()
        assert all(same_stats(a, b) for a, b in zip(dispatched, got))
    return got


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_bits_many_tensors(dtype):
    gen = _gen(1)
    sizes = [1, 31, 32, 33, 0, 100, 7]
    tensors = [random_bits(dtype, (n,), gen) for n in sizes]
    _check(tensors, f"{dtype} small chunks", **SMALL)
    _check(tensors + [random_bits(dtype, (3, 5000), gen)], f"{dtype} default launch")


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype):
    gen = _gen(2)
    special = special_values(dtype)
    # each special value also alone, and at the tail of a longer tensor (the masked block)
    tensors = [special] + [v.reshape(1) for v in special]
    tail = torch.cat([random_bits(dtype, (45,), gen), special])
    _check(tensors + [tail], f"{dtype} specials", **SMALL)
    _check([special, tail], f"{dtype} specials default launch")


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_tensors_and_one_nan_in_a_tail(dtype):
    # Finite inputs except one special in one tensor's last element: nothing may leak into the
    # neighbours (they share launches and the partials buffer).
    gen = _gen(3)
    if dtype == torch.bool:
        tensors = [torch.ones(n, dtype=torch.bool) for n in (40, 33, 65)]
        tensors[1][-1] = False
    elif dtype.is_floating_point:
        tensors = [torch.rand(n, generator=gen) * 4 + 0.25 for n in (40, 33, 65)]
        tensors[0][5] = -tensors[0][5]
        tensors[1][-1] = float("nan")
        tensors[2][-1] = float("-inf") if has_inf(dtype) else 0.0
        tensors = [t.to(dtype) for t in tensors]
    else:
        info = torch.iinfo(dtype)
        tensors = [torch.randint(max(info.min, -100), 100, (n,), generator=gen).to(dtype) for n in (40, 33, 65)]
        tensors[1][-1] = info.min
    got = _check(tensors, f"{dtype} tail", **SMALL)
    if dtype.is_floating_point:
        assert got[1]["nan"] == 1 and got[0]["nan"] == 0 and got[2]["nan"] == 0


@needs_backend
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.is_floating_point and d.itemsize == 1], ids=str)
def test_every_byte_of_the_8_bit_floats(dtype):
    """The 256 bit patterns in windows of 16 (each window's counts and extremes exact), together
    and without the NaN patterns; each special value alone is in test_special_values."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    finite = every[~torch.isnan(every.float())]
    windows = list(every.split(16))
    _check(windows + [every, finite], f"{dtype} every byte", block_size=16, blocks_per_chunk=1)
    _check([every, finite[3:]], f"{dtype} every byte default launch")


@needs_backend
def test_empty_and_zero_dim():
    gen = _gen(4)
    for dtype in DTYPES:
        tensors = [torch.empty(0, dtype=dtype), random_bits(dtype, (), gen), torch.empty(3, 0, dtype=dtype)]
        got = _check(tensors, f"{dtype} empty/0-dim")
        assert got[0]["abs_min"] is None and got[0]["numel"] == 0 and got[1]["numel"] == 1
    # a batch of only empty tensors launches no partials kernel
    _check([torch.empty(0), torch.empty(0, 4)], "only empty")
    assert tb.compute([]).shape == (0, 8)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int64], ids=str)
def test_non_contiguous(dtype):
    gen = _gen(5)
    base = random_bits(dtype, (6, 10), gen)
    cube = random_bits(dtype, (3, 4, 5), gen)
    views = [
        base.t(),  # dense, read flat over its memory
        cube.permute(2, 0, 1),  # dense
        base[:, ::3],  # gapped: copied
        base[1:4, 2:9],  # gapped: copied
        base.reshape(-1)[1:],  # contiguous but not 16-byte aligned
        base[2].reshape(1, 10).expand(4, 10),  # overlapping (stride 0): copied
        torch.zeros(4, 3, 2, 2, dtype=torch.float32).to(memory_format=torch.channels_last).to(dtype),
    ]
    if dtype.is_floating_point and dtype.itemsize > 1:  # torch has no fp8 negation
        # lazily negated: memory holds the opposite signs, so +inf and -inf would swap
        signed = torch.tensor([float("inf"), float("inf"), -float("inf"), -1.5, 0.0]).to(dtype)
        views.append(torch._neg_view(signed))
    _check(views, f"{dtype} views", **SMALL)
    _check(views, f"{dtype} views default launch")


@needs_backend
def test_mixed_dtypes_in_one_call():
    gen = _gen(6)
    tensors = []
    for i, dtype in enumerate(DTYPES * 2):  # 5 to 96 elements: one to four of SMALL's chunks
        tensors.append(random_bits(dtype, (5 + 13 * (i % 8),), gen))
    tensors.insert(3, torch.empty(0, dtype=torch.float16))
    tensors.append(special_values(torch.float32))
    _check(tensors, "mixed", **SMALL)
    _check(tensors, "mixed default launch")


@needs_backend
@pytest.mark.parametrize("count", [1, 2, 3, 5, 17, pytest.param(70, marks=pytest.mark.slow)])
def test_many_tensors_one_table(count):
    """Tensors of every dtype, sizes from empty to several chunks, aligned and not, empty ones
    first, last and in runs: the binary search over the chunk prefix sums finds every chunk's
    tensor (``count`` sets the number of search steps)."""
    gen = _gen(10 + count)
    sizes = [0, 0, 70, 1, 32, 0, 33, 64, 5]
    tensors = []
    for i in range(count):
        dtype = DTYPES[(3 * i) % len(DTYPES)]
        n = sizes[i % len(sizes)]
        t = random_bits(dtype, (n + 1,), gen)
        tensors.append(t[1:] if i % 3 == 2 else t[:n])  # [1:]: off a 16-byte boundary
    assert any(t.data_ptr() % 16 for t in tensors if t.numel()) or count < 3
    _check(tensors, f"{count} tensors", **SMALL)
    if count in (1, 70):
        _check(tensors, f"{count} tensors default launch")


@needs_backend
def test_one_launch_pair_and_one_table_per_call(monkeypatch):
    """Any mix of dtypes and alignments: two launches, the partials one with one program per
    chunk; a table of 4 ints per tensor plus one, whatever the number of chunks."""
    launches = []

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel, grid, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "_stats_partials_kernel", Counting(triton_kernels._stats_partials_kernel))
    monkeypatch.setattr(triton_kernels, "_stats_combine_kernel", Counting(triton_kernels._stats_combine_kernel))
    gen = _gen(11)
    tensors = [random_bits(torch.bfloat16, (100,), gen), random_bits(torch.int64, (33,), gen)[1:],
               torch.empty(0, dtype=torch.bool), random_bits(torch.float32, (7,), gen),
               random_bits(torch.bfloat16, (40,), gen)[3:]]
    _check(tensors, "launch count", **SMALL)
    partials, combine = launches
    assert partials[1] == (4 + 1 + 0 + 1 + 2,)  # chunks of 32 elements
    assert partials[2]["FORMATS"] == sum(1 << (triton_common._FORMAT_WORD[d] & triton_common._CODE_MASK) for d in
                                         (torch.bfloat16, torch.int64, torch.bool, torch.float32))
    assert partials[2]["ANY_UNALIGNED"] and partials[2]["SEARCH_STEPS"] == 3
    assert combine[1] == (5,)
    table, formats, unaligned, num_chunks = triton_table._table(
        [triton_table._flat_source(t) for t in tensors], [triton_common._FORMAT_WORD[t.dtype] for t in tensors], 32)
    assert len(table) == 4 * 5 + 1 and table[-6:] == [0, 4, 5, 5, 6, 8] and num_chunks == 8
    launches.clear()
    _check([torch.empty(0), torch.empty(0, dtype=torch.int8)], "only empty", **SMALL)
    assert [grid for _, grid, _ in launches] == [(2,)]  # no chunks: the combine launch only


@needs_backend
def test_cpp_table_and_python_table_give_the_same_rows(monkeypatch):
    """compute() and tensor_stats(out=) through the C++ table (dispatch's one loop), and through the
    Python table (no extension): the same rows, for dense, strided, expanded, negated, unaligned
    and empty tensors of several dtypes."""
    if triton_common._TRITON_TABLE is None:
        pytest.skip("overflow_fast._C is not loaded")
    gen = _gen(12)
    base = random_bits(torch.float32, (6, 40), gen).to(DEVICE)
    tensors = [base, base.t(), base[:, 1:7], base[0, :7].expand(3, 7), torch._neg_view(base[1]),
               random_bits(torch.bfloat16, (71,), gen).to(DEVICE)[1:], torch.empty(0, dtype=torch.int8, device=DEVICE),
               random_bits(torch.int64, (33,), gen).to(DEVICE)]
    out = torch.full((len(tensors) + 1, 8), -1, dtype=torch.int64, device=DEVICE)[1:]
    native = tb.compute(tensors, **SMALL).tolist()
    dispatched = tensor_stats(tensors, backend="triton", out=out).values.tolist()
    monkeypatch.setattr(triton_common, "_TRITON_TABLE", None)
    monkeypatch.setattr(dispatch, "_choices", {})
    assert tb.compute(tensors, **SMALL).tolist() == native
    assert tensor_stats(tensors, backend="triton", out=out.fill_(-1)).values.tolist() == dispatched == native
    assert_stats_equal(_rows_to_dicts(torch.tensor(native), tensors), [t.cpu() for t in tensors], "C++ table")


def test_pinned_staging_reuses_only_buffers_no_copy_reads():
    """The staging policy, with fake events (no GPU): a buffer whose copy may be pending is never
    handed out again; buffers are reused once their copy is done, grown when too small, and the
    oldest is waited for only at the cap."""
    class Event:
        def __init__(self):
            self.done = True
            self.waited = False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True
            self.done = True

        def record(self):
            self.done = False  # a copy from the buffer is now pending

    staging = triton_table._PinnedStaging(pinned_empty=lambda n: torch.empty(n, dtype=torch.int64), event=Event)
    first = staging.take(10)
    first[2].done = False  # its copy is pending
    second = staging.take(10)
    assert second[0] is not first[0]
    second[2].done = False
    first[2].done = True  # the oldest copy ran: its buffer is reused
    again = staging.take(10)
    assert again[0] is first[0] and len(staging.buffers) == 2
    again[2].done = False
    second[2].done = True
    grown = staging.take(5000)  # second's buffer is free but too small: replaced
    assert grown[0].numel() >= 5000 and len(staging.buffers) == 2
    for entry in staging.buffers:
        entry[2].done = False
    staging.MAX_BUFFERS = 2
    oldest = staging.buffers[0]
    assert staging.take(10) is oldest and oldest[2].waited  # at the cap: wait for the oldest

    # upload(): the table packed into a free buffer, copied to the front of the destination, and
    # the buffer marked pending until the copy has run (a CPU destination stands for the device)
    staging = triton_table._PinnedStaging(pinned_empty=lambda n: torch.empty(n, dtype=torch.int64), event=Event)
    table = [2**47 + 16, -1, 0, 2**63 - 1, -(2**63)]
    device_buffer = torch.full((8,), 7, dtype=torch.int64)
    staging.upload(table, device_buffer)
    assert device_buffer.tolist() == table + [7, 7, 7]
    (pending,) = staging.buffers
    assert not pending[2].done
    staging.upload([1, 2], device_buffer)
    assert device_buffer[:2].tolist() == [1, 2] and len(staging.buffers) == 2  # not the pending one


@needs_backend
def test_unsigned_wide_integers_match_torch_backend():
    # uint16/32/64 are not in the oracle's list; compare with the torch backend and Python ints
    gen = _gen(7)
    for name, signed in (("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64)):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        raw = torch.cat([random_bits(signed, (40,), gen), torch.tensor([0, -1, 1], dtype=signed)])
        raw = torch.cat([raw, torch.tensor([torch.iinfo(signed).min], dtype=signed)])
        x = raw.view(dtype).to(DEVICE)
        got = _rows_to_dicts(tb.compute([x], **SMALL), [x])[0]
        want = tensor_stats([x], backend="torch").tolist()[0]
        assert same_stats(got, want), (name, got, want)
        mask = (1 << (8 * dtype.itemsize)) - 1
        values = [v & mask for v in raw.tolist()]
        assert (got["abs_min"], got["abs_max"]) == (min(values), max(values))


@needs_backend
def test_supports():
    x = torch.zeros(3, device=DEVICE)
    assert tb.supports(x)
    assert not tb.supports(torch.zeros(3, dtype=torch.complex64, device=DEVICE))
    with pytest.raises(ValueError):
        tensor_stats([torch.zeros(3, dtype=torch.complex64, device=DEVICE)], backend="triton")
    assert not tb.supports(torch.zeros(3, device="meta"))
    if DEVICE == "cuda":
        assert not tb.supports(x.cpu())  # compiled kernels read device memory only


def test_imports_and_falls_back_without_triton(tmp_path):
    """A broken or missing Triton must not break ``import overflow_fast``: the backend says why."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("simulated: no triton here")\n')
    script = textwrap.dedent(
        """
        import warnings
        import torch
        import overflow_fast
        from overflow_fast.stats import dispatch, triton_backend
        reason = triton_backend.unavailable_reason()
        assert reason and "simulated" in reason, reason
        assert not triton_backend.supports(torch.zeros(2))
        assert dispatch.backend_status()["triton"] == reason
        x = torch.tensor([1.0, float("nan"), -2.0])
        assert overflow_fast.tensor_stats([x]).tolist()[0]["nan"] == 1
        try:
            overflow_fast.tensor_stats([x], backend="triton")
        except RuntimeError as error:
            assert "simulated" in str(error)
        else:
            raise AssertionError("backend='triton' should have raised")
        if torch.cuda.is_available():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                row = overflow_fast.tensor_stats([x.cuda()]).tolist()[0]
            assert row["nan"] == 1 and any("falling back" in str(w.message) for w in caught)
        print("fallback ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stdout + result.stderr


def _compile_for_sm90(kernel, signature, constexprs, num_warps, **options):
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        pytest.skip(f"triton's compiler API moved: {error}")
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    try:
        return triton_common.triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": num_warps, **options})
    except FileNotFoundError as error:  # no ptxas in this triton install
        pytest.skip(str(error))


def _compile_partials(formats, any_unaligned, search_steps=3):
    constexprs = dict(FORMATS=formats, ANY_UNALIGNED=any_unaligned, SEARCH_STEPS=search_steps,
                      BLOCK_SIZE=tb.BLOCK_SIZE, BLOCKS_PER_CHUNK=tb.BLOCKS_PER_CHUNK)
    return _compile_for_sm90(triton_kernels._stats_partials_kernel, {"Table_ptr": "*i64", "num_tensors": "i32"},
                             constexprs, tb.NUM_WARPS, **triton_common._REGISTER_CAP)


def _vector_loads(ptx):
    return ptx.count("ld.global.v4.b32") + ptx.count("ld.global.v2.b64")


@pytest.mark.skipif(triton_common.triton is None or triton_common._INTERPRET,
                    reason="needs triton's compiler (not the interpreter)")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                   *E8M0, torch.int64, torch.bool], ids=str)
def test_compiles_for_sm90_without_a_gpu(dtype):
    """The interpreter accepts code the compiler rejects: compile both kernels for an H100-class
    target (no GPU needed) and check that full blocks use 16-byte vector loads, also in a launch
    that has unaligned tensors (their scalar loop must not take the hint from the aligned one)."""
    code = triton_common._FORMAT_WORD[dtype] & triton_common._CODE_MASK
    aligned_only = _compile_partials(1 << code, False).asm["ptx"]
    assert _vector_loads(aligned_only) > 0
    both = _compile_partials(1 << code, True).asm["ptx"]
    assert _vector_loads(both) == _vector_loads(aligned_only)
    scalar = {1: "ld.global.b8", 2: "ld.global.b16", 4: "ld.global.b32", 8: "ld.global.b64"}[dtype.itemsize]
    assert both.count(scalar) > aligned_only.count(scalar)  # the unaligned loop
    _compile_for_sm90(triton_kernels._stats_combine_kernel,
                      {"Table_ptr": "*i64", "Out_ptr": "*i64", "num_tensors": "i32"}, {"BLOCK_SIZE": tb.COMBINE_BLOCK}, 2)


@pytest.mark.skipif(triton_common.triton is None or triton_common._INTERPRET,
                    reason="needs triton's compiler (not the interpreter)")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_every_format_compiles_in_one_kernel(tmp_path):
    """Every format branch, aligned and unaligned, in one partials kernel (the largest variant)."""
    every = (1 << len(triton_common._FORMATS)) - 1
    kernel = _compile_partials(every, True, search_steps=8)
    assert _vector_loads(kernel.asm["ptx"]) >= len(triton_common._FORMATS)
    # the register cap holds without spills (cuobjdump ships with triton's CUDA backend)
    cuobjdump = os.path.join(os.path.dirname(triton_common.triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(cuobjdump) and triton_common._REGISTER_CAP:
        cubin = os.path.join(str(tmp_path), "partials.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
        registers = int(re.search(r"REG:(\d+)", usage).group(1))
        assert registers <= tb.MAX_REGISTERS and "LOCAL:0" in usage and "STACK:0" in usage, usage


@needs_backend
def test_rows_written_into_out():
    # check="batch" hands the kernels the next rows of its device buffer
    gen = _gen(9)
    tensors = [random_bits(torch.bfloat16, (40,), gen).to(DEVICE), torch.empty(0, device=DEVICE),
               random_bits(torch.int32, (33,), gen).to(DEVICE)]
    buffer = torch.full((5, 8), -1, dtype=torch.int64, device=DEVICE)
    rows = tb.compute(tensors, out=buffer[1:4], **SMALL)
    assert rows.data_ptr() == buffer[1].data_ptr()
    want = tensor_stats(tensors, backend="torch").tolist()
    for got, expected in zip(_rows_to_dicts(buffer[1:4], tensors), want):
        assert same_stats(got, expected)
    assert (buffer[0] == -1).all() and (buffer[4] == -1).all()
    batch = tensor_stats(tensors, backend="triton", out=buffer[1:4])
    assert batch.values.data_ptr() == buffer[1].data_ptr()


@needs_backend
def test_launches_run_under_the_tensors_device(monkeypatch):
    # A tensor on cuda:1 (device_map="auto") must be read on cuda:1, not on the current device:
    # every launch happens inside on_device(tensors' device). No GPU here: record the guard.
    entered = []
    launched_inside = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    real_launch = triton_table._launch

    def launch(*args, **kwargs):
        launched_inside.append(bool(entered) and entered[-1] is not None)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(triton_table, "on_device", Guard)
    monkeypatch.setattr(triton_table, "_launch", launch)
    tensors = [torch.arange(5.0, device=DEVICE), torch.tensor([1, -3], device=DEVICE)]
    got = _rows_to_dicts(tb.compute(tensors), tensors)
    assert got == tensor_stats(tensors, backend="torch").tolist()
    assert entered == [torch.device(DEVICE), None] and launched_inside == [True]


def test_device_guard_names_the_tensors_cuda_device():
    guard = tb.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # entering needs a GPU
    assert not isinstance(tb.on_device(torch.device("cpu")), torch.cuda.device)


@needs_backend
@pytest.mark.parametrize("defer", [False, True])
def test_detector_reads_each_hook_or_with_defer_the_forward_at_once(monkeypatch, defer):
    import copy

    from torch import nn

    import overflow_fast.stats.kinds
    from compat import ReferenceDetector, forward, run
    from overflow_fast import DebugUnderflowOverflow

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))
    data = [torch.randn(2, 8) for _ in range(4)]
    data[3][0, 0] = float("inf")
    calls = []
    real = triton_table._launch
    real_read = triton_list._launch_read

    def counting(buffer, out, num_tensors, *args):
        # one per engine call through the table kernels: compute() or dispatch's C++ table
        calls.append(num_tensors)
        return real(buffer, out, num_tensors, *args)

    def counting_read(*args):
        calls.append("list")  # one per engine call through the list kernel in Python (no extension)
        return real_read(*args)

    def launcher_reads():
        """Launches of the list kernel by the device's C++ launcher (at most 8 tensors here: one a call)."""
        state = triton_devices._DEVICES.get((torch.device(DEVICE).type, torch.device(DEVICE).index))
        launcher = state.launcher if state is not None else None
        return 0 if launcher is None else launcher.direct_launches + launcher.ordinary_launches

    monkeypatch.setattr(triton_table, "_launch", counting)
    monkeypatch.setattr(triton_list, "_launch_read", counting_read)
    monkeypatch.setattr(overflow_fast.stats.kinds, "CPU_AS_DEVICE", True)  # the interpreter's tensors are on the CPU
    model = model.to(DEVICE)
    data = [x.to(DEVICE) for x in data]
    want = run(ReferenceDetector, copy.deepcopy(model), data, forward)[:2]
    got = run(DebugUnderflowOverflow, copy.deepcopy(model), data, forward, check="batch", backend="triton",
              defer=defer)[:2]
    assert got == want and "has infs" in got[0]
    fresh = DebugUnderflowOverflow(model, check="batch", backend="triton", defer=defer)
    for x in data[:3]:
        calls.clear()
        before = launcher_reads()
        forward(model, x)
        calls += ["list"] * (launcher_reads() - before)
    if defer:
        # forwards 2 and 3: the ReLU(inplace=True) rewrites the second Linear's output after its
        # hook, so that Linear reads in its hook; everything else waits for the end of the forward
        assert len(calls) == 2, calls
    else:  # one engine call per hook with tensors not read before in this forward (ReLU's in place)
        assert len(calls) == 5, calls
    fresh.remove()


def test_importing_the_engine_loads_no_extension():
    """The C++ extension is loaded (and built if need be) where a caller first asks for it, never
    by an import: a process that only imports the engine has no overflow_fast._C (ops.py, the torch
    ops, loads it on import to register them; dispatch imports it only while tracing)."""
    code = ("import sys\n"
            "from overflow_fast.stats import dispatch, triton_backend\n"
            "assert 'overflow_fast._C' not in sys.modules, 'imported'\n"
            "triton_backend.table_words(__import__('torch').device('cpu'))\n"
            "print('overflow_fast._C' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loads = os.environ.get("OVERFLOW_FAST_WITHOUT_EXTENSION", "") in ("", "0")
    assert done.stdout.strip() == str(loads and triton_common.triton is not None)
