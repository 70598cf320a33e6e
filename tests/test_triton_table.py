"""The Triton backend's table built in C++ (``_C.triton_table`` through ``triton_backend.scan``)
against the Python ``_table``, int for int, and dispatch's path through it. No kernel runs here:
the launches of ``tensor_stats`` are stubbed (the kernels' own tests are test_triton_backend.py).
"""

import contextlib
import importlib
import sys

import pytest
import torch

from overflow_fast import tensor_stats
from overflow_fast.stats import dispatch
from overflow_fast.stats import triton_backend as tb
from overflow_fast.stats import triton_common, triton_kernels, triton_table

pytestmark = pytest.mark.skipif(triton_common._TRITON_TABLE is None, reason="overflow_fast._C is not loaded")

DTYPES = sorted(triton_common._FORMAT_WORD, key=str)
CHUNK = 32


def _python_table(tensors, sources, chunk):
    words = [triton_common._FORMAT_WORD[t.dtype] for t in tensors]
    return triton_table._table(sources, words, chunk)


def _assert_same_table(tensors, chunk=CHUNK):
    """scan() gives _table's ints (with the flat copies scan made as the sources), FORMATS bitmask,
    the bitmask of the formats of an unaligned tensor and the chunk count; the flat copies are of exactly the tensors _flat_source copies."""
    scanned = tb.scan(tensors, triton_common._FORMAT_WORD, chunk)
    assert scanned is not None
    sources = list(tensors)
    for index, source in scanned.flat or ():
        sources[index] = source
    flat = {index for index, _ in scanned.flat or ()}
    assert flat == {i for i, t in enumerate(tensors) if triton_table._flat_source(t) is not t}
    table, formats, unaligned, num_chunks = _python_table(tensors, sources, chunk)
    n = 4 * len(tensors) + 1
    assert scanned.table[:n].tolist() == table
    assert (scanned.formats, scanned.unaligned, scanned.num_chunks) == (formats, unaligned, num_chunks)
    assert scanned.dtypes == [t.dtype for t in tensors]
    return scanned


def _layouts(dtype):
    """Contiguous, 0-dim, empty, sliced (unaligned starts), transposed, gapped, expanded, negated,
    permuted, several chunks."""
    base = torch.zeros(6, 40, dtype=torch.int64).view(dtype)[:, :40]  # any dtype, 16-byte aligned rows
    flat = base.reshape(-1)
    yield flat[:100]
    yield flat[0]  # 0-dim
    yield flat[:0]
    yield flat[5:5]  # empty, mid-storage
    yield flat[1:70]  # unaligned start for itemsize < 16
    yield flat[3:]  # several chunks
    yield base.t()  # transposed: dense
    yield base[:, 1:7]  # gapped: copied
    yield base[1:4, 2:9].t()  # gapped and transposed
    yield flat[:7].expand(3, 7)  # overlapping: copied
    yield flat[:1].expand(5)  # stride 0, size > 1
    yield flat[:1].expand(1, 1)
    yield base.reshape(2, 3, 40).permute(2, 0, 1)  # dense, permuted
    yield base.unsqueeze(1)[:, :, ::2]  # gapped with a size-1 dim
    yield flat[:24].view(2, 3, 4)[:, :1, :]  # size-1 dim with an odd stride: dense
    try:
        torch._neg_view(flat[:1]).resolve_neg()
    except (RuntimeError, NotImplementedError):  # no negation for this dtype (fp8, bool, unsigned)
        return
    yield torch._neg_view(flat[:50])  # lazily negated: copied
    yield torch._neg_view(flat[1:9])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_layout_matches_the_python_table(dtype):
    tensors = list(_layouts(dtype))
    _assert_same_table(tensors)
    _assert_same_table(tensors, chunk=tb.BLOCK_SIZE * tb.BLOCKS_PER_CHUNK)
    for tensor in tensors:
        _assert_same_table([tensor], chunk=7)


def test_mixed_dtypes_parameters_and_many_tensors():
    gen = torch.Generator().manual_seed(3)
    tensors = []
    for i in range(300):
        dtype = DTYPES[i % len(DTYPES)]
        layouts = list(_layouts(dtype))
        tensors.append(layouts[int(torch.randint(len(layouts), (1,), generator=gen))])
    tensors.append(torch.nn.Parameter(torch.ones(33, 3)))
    tensors.append(torch.nn.Parameter(torch.ones(2, 33)).t())  # a view of a Parameter: a Tensor
    scanned = _assert_same_table(tensors)
    assert scanned.formats == sum(1 << (triton_common._FORMAT_WORD[d] & triton_common._CODE_MASK)
                                  for d in {t.dtype for t in tensors})


def test_a_table_in_a_larger_buffer_is_written_at_its_start():
    """As into a pinned staging buffer larger than the table (the CUDA path): the rest is untouched."""
    tensors = [torch.ones(40), torch.ones(3, dtype=torch.int8)[1:]]
    table = torch.full((20,), 7, dtype=torch.int64)
    result = triton_common._TRITON_TABLE(tensors, triton_common._PLAIN_TYPES, torch.device("cpu"),
                                         triton_common._FORMAT_WORD, CHUNK, table, triton_common._ALIGNED_BIT, 0, 0, False)
    assert result is not None
    want, formats, unaligned, num_chunks = _python_table(tensors, tensors, CHUNK)
    assert table[:9].tolist() == want and table[9:].tolist() == [7] * 11
    int8 = 1 << (triton_common._FORMAT_WORD[torch.int8] & triton_common._CODE_MASK)
    assert result[:3] == (formats, unaligned, num_chunks) == (formats, int8, 3)


class _Subclass(torch.Tensor):
    pass


def _not_taken():
    """Tensors the C++ loop leaves to Python (it returns None for the whole call)."""
    yield "complex", torch.ones(3, dtype=torch.complex64)
    yield "meta", torch.ones(3, device="meta")
    yield "subclass", torch.ones(3).as_subclass(_Subclass)
    yield "sparse", torch.ones(3).to_sparse()
    yield "csr", torch.eye(3).to_sparse_csr()
    yield "nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    yield "jagged", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    yield "zero tensor", torch._efficientzerotensor(3)
    yield "quantized", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    yield "not a tensor", 3.0
    yield "None", None
    with contextlib.suppress(Exception):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            fake = torch.ones(3)
        yield "fake", fake
    with contextlib.suppress(Exception):
        importlib.import_module("torch._subclasses.functional_tensor")  # absent from older torch
        yield "functional", torch._to_functional_tensor(torch.ones(3))


@pytest.mark.parametrize("label,odd", list(_not_taken()), ids=lambda v: v if isinstance(v, str) else "")
def test_what_it_does_not_read_goes_to_python(label, odd):
    calls = ([odd], [torch.ones(3), odd], [odd, torch.ones(3)]) if isinstance(odd, torch.Tensor) else \
        ([torch.ones(3), odd],)  # scan() reads the device of the first: its callers' tensor
    for tensors in calls:
        assert tb.scan(tensors, triton_common._FORMAT_WORD, CHUNK) is None, label


def test_functorch_wrapped_tensors_go_to_python():
    seen = []

    def scan(x):
        seen.append(tb.scan([torch.ones(2), x], triton_common._FORMAT_WORD, CHUNK))
        return x

    torch.func.vmap(scan)(torch.ones(3, 2))
    torch.func.grad(lambda x: scan(x).sum())(torch.ones(3))
    assert seen == [None, None]


def test_a_dtype_missing_from_words_and_another_device_go_to_python():
    words = {torch.float32: triton_common._FORMAT_WORD[torch.float32]}
    assert tb.scan([torch.ones(3), torch.ones(3, dtype=torch.float16)], words, CHUNK) is None
    assert tb.scan([torch.ones(3), torch.ones(3)], words, CHUNK) is not None


def test_bad_arguments_raise():
    tensors = [torch.ones(3)]
    args = (tensors, triton_common._PLAIN_TYPES, torch.device("cpu"), triton_common._FORMAT_WORD, CHUNK)
    with pytest.raises(RuntimeError, match="table must be"):
        triton_common._TRITON_TABLE(*args, torch.empty(4, dtype=torch.int64), triton_common._ALIGNED_BIT, 0, 0,
                                    False)  # too short
    with pytest.raises(RuntimeError, match="table must be"):
        triton_common._TRITON_TABLE(*args, torch.empty(5, dtype=torch.int32), triton_common._ALIGNED_BIT, 0, 0, False)
    with pytest.raises(RuntimeError, match="chunk"):
        triton_common._TRITON_TABLE(tensors, triton_common._PLAIN_TYPES, torch.device("cpu"), triton_common._FORMAT_WORD,
                                    0, torch.empty(5, dtype=torch.int64), triton_common._ALIGNED_BIT, 0, 0, False)
    with pytest.raises(RuntimeError, match="words"):
        triton_common._TRITON_TABLE(tensors, triton_common._PLAIN_TYPES, torch.device("cpu"), {"float32": 1}, CHUNK,
                                    torch.empty(5, dtype=torch.int64), triton_common._ALIGNED_BIT, 0, 0, False)


def test_overlaps_and_empties_are_listed():
    storage = torch.zeros(64)
    inside, empty_inside, outside = storage[8:16], storage[20:20], torch.ones(4)
    first = storage.untyped_storage().data_ptr()
    scanned = tb.scan([outside, inside, empty_inside, torch.ones(0)], triton_common._FORMAT_WORD, CHUNK,
                      out_storage=(first, first + storage.untyped_storage().nbytes()), list_empty=True)
    assert scanned.overlaps == [1] and scanned.empties == [2, 3]
    scanned = tb.scan([outside, inside, empty_inside], triton_common._FORMAT_WORD, CHUNK)
    assert scanned.overlaps == [] and scanned.empties == []


# -- dispatch: tensor_stats through the C++ table, launches stubbed ---------------------------------------

class _StubKernel:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(grid)
            if len(args) == 3:  # combine: (buffer, out, num_tensors); the rows it would write
                args[1].zero_()
        return launch


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """CPU tensors routed to the triton backend (as under TRITON_INTERPRET=1), launches stubbed;
    yields the list of scan() results."""
    launches, scans = [], []
    real_scan = tb.scan

    def scan(*args, **kwargs):
        scans.append(real_scan(*args, **kwargs))
        return scans[-1]

    def supports(t):
        return t.device.type == "cpu" and t.dtype in triton_common._FORMAT_WORD and t.layout == torch.strided

    for module in (tb, triton_common):  # where the dispatch reads them, and where the backend does
        monkeypatch.setattr(module, "supports", supports)
        monkeypatch.setattr(module, "unavailable_reason", lambda: None)
    monkeypatch.setattr(triton_kernels, "_stats_partials_kernel", _StubKernel(launches))
    monkeypatch.setattr(triton_kernels, "_stats_combine_kernel", _StubKernel(launches))
    monkeypatch.setattr(tb, "scan", scan)
    monkeypatch.setattr(triton_table, "scan", scan)
    monkeypatch.setattr(tb, "MAX_READ_LAUNCHES", 0)  # the table path: the per-hook kernel takes no call
    with dispatch.preferring("cpu", "triton"):
        yield scans


def test_tensor_stats_takes_the_cpp_table(triton_on_cpu):
    tensors = [torch.ones(100, dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(3, 4)),
               torch.ones(8, 8)[:, :3], torch.ones(0)]
    out = torch.full((4, 8), -1, dtype=torch.int64)
    batch = tensor_stats(tensors, out=out)
    assert batch.values is out and out.eq(0).all()  # the stub combine wrote the rows
    assert batch.dtypes == [t.dtype for t in tensors]
    (scanned,) = triton_on_cpu
    assert [index for index, _ in scanned.flat] == [2]
    assert tensor_stats(tensors).values.shape == (4, 8)
    assert len(triton_on_cpu) == 2


@pytest.mark.parametrize("overlap", ["input", "view"])
def test_out_overlapping_an_input_still_raises(triton_on_cpu, overlap):
    buffer = torch.zeros(3, 8, dtype=torch.int64)
    if overlap == "input":
        tensors, out = [torch.ones(3), buffer[1:3]], buffer[1:3]
    else:
        tensors, out = [buffer[1, 4:]], buffer[1:2]
    with pytest.raises(ValueError, match=r"out overlaps the memory of tensors\[%d\]" % (len(tensors) - 1)):
        tensor_stats(tensors, out=out)
    assert triton_on_cpu and triton_on_cpu[0].overlaps  # found by the C++ loop
    # a tensor inside out's allocation but outside its rows is fine
    out = buffer[0:1]
    tensor_stats([buffer[2]], out=out)


def test_other_calls_take_the_general_path(triton_on_cpu):
    out = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="out is on meta"):
        tensor_stats([torch.ones(3), torch.ones(3)], out=torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="not a tensor"):
        tensor_stats([torch.ones(3), 3.0], out=out)
    assert triton_on_cpu == [None]  # the meta out: not even scanned
    # a complex tensor goes to the torch backend: two groups, rows placed into out
    batch = tensor_stats([torch.ones(3), torch.ones(3, dtype=torch.complex64)], out=out)
    assert batch.values is out and out[1, 7] == 3
    assert triton_on_cpu[1] is None and len(triton_on_cpu[2].tensors) == 1  # then compute() of its group
    assert tensor_stats([torch.ones(3)], backend="torch").values[0, 7] == 3
    assert len(triton_on_cpu) == 3


def test_released_zero3_parameters_take_the_general_path(triton_on_cpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("deepspeed") or type(sys)("deepspeed"))
    released = torch.nn.Parameter(torch.ones(0))
    released.ds_tensor = torch.full((4,), 2.0)
    released.ds_numel = 4
    batch = tensor_stats([torch.ones(3), released])
    scanned, partition = triton_on_cpu  # dispatch's, then compute()'s of the partition's targets
    assert scanned.empties == [1]  # listed, found released, so the call went the general way
    assert partition.table[2 + 1].item() == 4  # numel column (from T = 2 on): the partition's
    assert batch.values.shape == (2, 8)
