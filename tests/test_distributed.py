"""Distributed building blocks: exact merging of shard rows, and (2 processes, gloo, CPU) the
collectives of overflow_fast.distributed on DTensors, FSDP2 and agreement between ranks."""

import os
import random

import pytest
import torch

from oracle import ALL_DTYPES, random_bits, reference_stats, same_stats, special_values
from overflow_fast import tensor_stats
from overflow_fast.stats.layout import decode_row, is_integer_dtype, merge_rows, merge_rows_tensor

# -- merge_rows: exact, every dtype, special values, empty shards --------------------------------


def _pool(dtype, generator):
    """Special values and random bit patterns of ``dtype``, shuffled."""
    values = torch.cat([special_values(dtype).reshape(-1), random_bits(dtype, (24,), generator).reshape(-1)])
    order = torch.randperm(values.numel(), generator=generator)
    return values[order]


def _cuts(numel, rng, shards):
    """``shards`` split points over [0, numel], empty pieces included."""
    points = sorted(rng.randint(0, numel) for _ in range(shards - 1))
    return [0] + points + [numel]


def _pieces(dtype, rng, generator):
    whole = _pool(dtype, generator)
    size = rng.choice([0, 1, 2, 5, whole.numel()])
    whole = whole[rng.randrange(0, whole.numel() - size + 1):][:size] if size < whole.numel() else whole
    cuts = _cuts(whole.numel(), rng, rng.choice([1, 2, 3, 5]))
    return whole, [whole[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_merge_rows_equals_the_whole_tensor(dtype):
    rng = random.Random(str(dtype))
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    wholes, shard_lists = [], []
    for _ in range(40):
        whole, shards = _pieces(dtype, rng, generator)
        wholes.append(whole)
        shard_lists.append(shards)
    want = tensor_stats(wholes).tolist()
    for whole, shards, expected in zip(wholes, shard_lists, want):
        rows = tensor_stats(shards).host_rows()
        got = decode_row(merge_rows(rows, dtype), dtype)
        label = f"{dtype} shards {[s.tolist() for s in shards]}"
        assert same_stats(got, expected), f"{label}: got {got}, want {expected}"
        assert same_stats(got, reference_stats(whole)), label
        # the device version, one tensor at a time
        device = merge_rows_tensor(torch.tensor(rows, dtype=torch.int64), is_integer_dtype(dtype))
        assert same_stats(decode_row(device.tolist(), dtype), expected), label


def test_merge_rows_tensor_many_tensors_of_mixed_dtypes_at_once():
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    shards_count = 3
    columns, wants, dtypes = [], [], []
    for dtype in ALL_DTYPES * 3:
        whole = _pool(dtype, generator)[: rng.choice([0, 1, 4, 9])]
        cuts = _cuts(whole.numel(), rng, shards_count)
        rows = tensor_stats([whole[a:b] for a, b in zip(cuts, cuts[1:])]).values  # [S, 8]
        columns.append(rows)
        wants.append(tensor_stats([whole]).tolist()[0])
        dtypes.append(dtype)
    stacked = torch.stack(columns, dim=1)  # [S, N, 8]
    integer = torch.tensor([is_integer_dtype(d) for d in dtypes])
    merged = merge_rows_tensor(stacked, integer).tolist()
    for row, dtype, want in zip(merged, dtypes, wants):
        assert same_stats(decode_row(row, dtype), want), dtype


def test_merge_rows_nan_pattern_and_unsigned_order():
    nan_bits = 0x7FF8000000000000
    one = 0x3FF0000000000000
    assert merge_rows([[one, one, 0, 0, 0, 0, 0, 1], [nan_bits, nan_bits, 1, 0, 0, 0, 0, 2]],
                      torch.float32) == [nan_bits, nan_bits, 1, 0, 0, 0, 0, 3]
    # |-2**63| = 2**63 is stored as int64 -2**63: larger than any other magnitude
    big = -(2**63)
    assert merge_rows([[big, big, 0, 0, 0, 0, 0, 1], [5, 9, 0, 0, 0, 0, 0, 4]], torch.int64)[:2] == [5, big]
    # empty shards only: the empty tensor's row
    assert merge_rows([[0] * 8, [0] * 8], torch.float16) == [0] * 8
    assert merge_rows([], torch.float16) == [0] * 8


# -- two processes, gloo on CPU ------------------------------------------------------------------

import datetime  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

import torch.multiprocessing as mp  # noqa: E402

from overflow_fast import distributed  # noqa: E402

WORLD = 2
SPAWN_TIMEOUT = 50  # seconds for a whole multi-process test: a hang fails it instead of hanging CI
PG_TIMEOUT = datetime.timedelta(seconds=30)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, fn, port, args, world=WORLD):
    import faulthandler
    import gc
    import sys

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a worker killed by a signal (abort, segfault) shows where

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's finalization. A process group that outlives
    # destroy_process_group (DeepSpeed's parameters keep theirs) still has gloo worker threads,
    # and one that frees a tensor's Python object while the interpreter shuts down is ended by
    # CPython mid-C++ (std::terminate, SIGABRT; pytorch/pytorch#179291): a crash of torch's
    # teardown after the test's work is done and checked. A worker that raised exits normally,
    # so that spawn reports its traceback.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, timeout=SPAWN_TIMEOUT, world=WORLD):
    """Run ``fn(rank, *args)`` on ``world`` (2) spawned processes in a gloo process group; a
    worker's exception fails the test with its traceback, and so does a worker still running at
    ``timeout`` (it is killed)."""
    context = mp.start_processes(_entry, args=(fn, _free_port(), args, world), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{fn.__name__}: the ranks did not finish within {timeout} s (a hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def test_single_process_has_no_rank():
    assert distributed.world() is None
    assert distributed.rank_prefix() is None
    assert distributed.with_prefix("a\nb", None) == "a\nb"
    assert distributed.agree(True) == [0]
    assert distributed.agree(False) == []
    rows = tensor_stats([torch.ones(3)]).values
    assert distributed.global_rows(rows, [torch.ones(3)]) is rows
    agreement = distributed.Agreement(timeout=1)
    assert agreement.agree(True) == [0] and agreement.agree(False) == [] and agreement.ranks == [0]


class _Work:
    """A gloo work whose first waits time out (``timeouts`` of them), then succeed."""

    def __init__(self, timeouts):
        self.timeouts = timeouts

    def wait(self, timeout=None):
        if self.timeouts:
            self.timeouts -= 1
            raise RuntimeError("Operation timed out!")


class _Group:
    """Rank 1's side of a 2-rank agreement, in process: its row joins this rank's."""

    def __init__(self, peer_row, timeouts=0):
        self.peer_row = peer_row
        self.timeouts = timeouts

    def allreduce(self, tensors):
        tensors[0][1] = torch.tensor(self.peer_row)
        return _Work(self.timeouts)


def _two_rank_agreement(group, store):
    """Rank 0 of a 2-rank Agreement on an in-process store and a fake group (the races of a
    rank giving up while another completes, which real ranks cannot time reliably)."""
    return distributed.Agreement.over(group, store, [0, 1], 0, datetime.timedelta(seconds=10))


def test_agreement_given_up_as_a_peer_completes_it():
    import torch.distributed as dist

    now_ms = time.time_ns() // 1_000_000
    # rank 0's wait ran out, but rank 1 had completed the agreement and said so: rank 0 takes it
    store = dist.HashStore()
    agreement = _two_rank_agreement(_Group([1, 1, now_ms, 10_000], timeouts=1), store)
    store.set("verdict/1", "done")
    assert agreement.agree(False) == [1]
    # rank 1 started 8 s ago: rank 0, completing now, settles with it; rank 1 had given up
    store = dist.HashStore()
    agreement = _two_rank_agreement(_Group([1, 1, now_ms - 8_000, 10_000]), store)
    store.set("verdict/1", "abandoned: rank 1 gave up agreement 1 after waiting 10.00 s for rank(s) 0")
    with pytest.raises(distributed.AgreementError, match="completed only after rank 1 gave up"):
        agreement.agree(True)
    with pytest.raises(distributed.AgreementError, match="unusable"):
        agreement.agree(True)
    # a timely peer: no store access at all
    agreement = _two_rank_agreement(_Group([1, 0, now_ms, 10_000]), None)
    assert agreement.agree(True) == [0]
    with pytest.raises(ValueError, match="not above"):
        agreement.agree(True, seq=1)


def _canonical(rows):
    """NaN patterns made one (backends may write different NaN bits; all decode to NaN)."""
    out = []
    for row in rows:
        row = list(row)
        for column in (0, 1):
            if (row[column] & 0x7FFFFFFFFFFFFFFF) > 0x7FF0000000000000 and row[-1]:
                row[column] = "nan"
        out.append(row)
    return out


def _full_tensors():
    """The same tensors on every rank: special values included, sizes that leave a shard empty."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(5, 4, generator=generator) * 1e4
    matrix[4, 3] = float("inf")
    matrix[0, 1] = 1e-41  # subnormal in float32
    with_nan = torch.randn(3, 6, generator=generator)
    with_nan[2, 5] = float("nan")
    one_row = torch.randn(1, 4, generator=generator)  # Shard(0) over 2 ranks: rank 1's shard is empty
    ints = torch.tensor([[-(2**63), 3], [0, 7], [5, -1]], dtype=torch.int64)
    halves = (torch.randn(4, 2, generator=generator) * 3e4).to(torch.bfloat16)
    return matrix, with_nan, one_row, ints, halves


def _dtensor_worker(rank):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    assert distributed.world() == (rank, WORLD)
    assert distributed.rank_prefix() == f"[rank {rank}/{WORLD}] "
    mesh = init_device_mesh("cpu", (WORLD,))
    matrix, with_nan, one_row, ints, halves = _full_tensors()
    fulls, dtensors = [], []
    for full in (matrix, with_nan, one_row):
        for placement in (Shard(0), Shard(1), Replicate()):
            fulls.append(full)
            dtensors.append(distribute_tensor(full, mesh, [placement]))
    for full in (ints, halves):  # no scatter for these dtypes: each rank builds its chunk
        for dim in (0, 1):
            fulls.append(full)
            dtensors.append(DTensor.from_local(full.chunk(WORLD, dim)[rank] if rank < len(full.chunk(WORLD, dim))
                                               else full.narrow(dim, 0, 0), mesh, [Shard(dim)], run_check=False))
    # tensor parallel: a row-wise Linear holds its weight as Shard(1), its bias replicated
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 3)
    reference = [linear.weight.detach().clone(), linear.bias.detach().clone()]
    parallelize_module(linear, mesh, RowwiseParallel())
    assert linear.weight.placements == (Shard(1),)
    fulls += reference
    dtensors += [linear.weight, linear.bias]
    # a plain tensor among them keeps its own row
    plain = torch.arange(rank, rank + 4, dtype=torch.float32)
    tensors = dtensors + [plain]
    want = _canonical(tensor_stats(fulls + [plain]).host_rows())

    local = tensor_stats(tensors).values  # the engine reads each DTensor's local shard
    got = distributed.global_rows(local, tensors)
    assert _canonical(got.tolist()) == want
    # host rows, and ShardInfo instead of the tensors (what a deferred buffer keeps)
    infos = [distributed.shard_info(t) for t in tensors]
    assert _canonical(distributed.global_rows(local.tolist(), infos)) == want
    assert all(distributed.is_exact(t) for t in tensors)
    # inside local_only() rows stay local and no collective runs
    with distributed.local_only():
        assert distributed.global_rows(local, tensors) is local

    # Partial: the terms are merged as shards, so a nan in one rank's term is seen by both
    term = torch.ones(2, 2) if rank == 0 else torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    partial = DTensor.from_local(term, mesh, [Partial()], run_check=False)
    assert not distributed.is_exact(partial)
    row = distributed.global_rows(tensor_stats([partial]).values, [partial])[0].tolist()
    assert row[2] == 1 and row[-1] == 8

    # agreement: every rank learns which ranks detected
    assert distributed.agree(rank == 1) == [1]
    assert distributed.agree(True) == [0, 1]
    assert distributed.agree(False) == []
    assert distributed.agree(rank == 0, timeout=20) == [0]
    with distributed.local_only():  # no collective: each rank alone
        assert distributed.agree(rank == 1) == ([1] if rank == 1 else [])
    error = distributed.OverflowOnRanks(distributed.agree(rank == 1))
    assert isinstance(error, ValueError) and "detected on rank(s) 1," in str(error)
    # a subgroup: global ranks are returned
    group = dist.new_group([0, 1])
    assert distributed.agree(rank == 0, group=group) == [0]


def test_dtensor_rows_equal_the_full_tensor_and_ranks_agree():
    run_ranks(_dtensor_worker)


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3, bias=False),
                               torch.nn.LayerNorm(3))


def _fsdp_worker(rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    reference = _tiny_model()
    with torch.no_grad():
        reference[2].weight[2, 1] = float("inf")  # in rank 1's shard (rows 2.. of 3)
    want = _canonical(tensor_stats([p.detach() for p in reference.parameters()]).host_rows())
    model = _tiny_model()
    with torch.no_grad():
        model[2].weight[2, 1] = float("inf")
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    assert all(distributed.shard_info(p) is not None for p in params)
    local = tensor_stats(params).values
    inf_rows = [row[3] for row in local.tolist()]
    assert (sum(inf_rows) == 1) == (rank == 1)  # only rank 1's shard holds the inf
    assert _canonical(distributed.global_rows(local, params).tolist()) == want
    # what the detector would then decide: both ranks stop, naming rank 1
    assert distributed.agree(sum(inf_rows) > 0) == [1]


def test_fsdp2_shards_combine_to_the_unsharded_parameters():
    run_ranks(_fsdp_worker)


def _ddp_worker(rank, steps_file):
    from torch.nn.parallel import DistributedDataParallel

    from overflow_fast import DebugUnderflowOverflow
    from overflow_fast.hooks.detector import OverflowDetected

    model = _tiny_model()
    detector = DebugUnderflowOverflow(model, check="batch", sync=False)  # each rank decides alone
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    stopped = None
    for step in range(5):
        batch = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 2 and rank == 1:
            batch[0, 0] = float("nan")
        detected = False
        try:
            loss = ddp(batch).sum()
        except OverflowDetected:
            detected = True
        ranks = distributed.agree(detected)  # every rank, once per forward
        if ranks:
            stopped = (step, distributed.OverflowOnRanks(ranks))
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    detector.remove()
    assert stopped is not None and stopped[0] == 2, stopped
    assert stopped[1].ranks == [1] and "detected on rank(s) 1," in str(stopped[1])


def test_ddp_nan_on_one_rank_every_rank_stops_at_the_same_step(tmp_path):
    """With sync=False the detector decides per rank, as the reference does; agree() after each
    forward is then the hand-written way to stop together (the detector's own, with sync on, is
    tested in test_distributed_detector.py)."""
    run_ranks(_ddp_worker, str(tmp_path))


# -- the Agreement: its own process group, sequence numbers ------------------------------------

def _waited(error):
    """The seconds an error's message says its rank waited."""
    return float(re.search(r"waited (\d+\.\d+) s", str(error)).group(1))


def _model_all_reduce(rank, world):
    """The model's own collective on the default group: its sum must come out right."""
    import torch.distributed as dist

    values = torch.tensor([1.5, 2.5]) * (rank + 1)
    dist.all_reduce(values)
    scale = world * (world + 1) / 2
    assert values.tolist() == [1.5 * scale, 2.5 * scale], values


def _agreement_worker(rank, world):
    import torch.distributed as dist

    from overflow_fast.distributed import Agreement, AgreementError, AgreementMisaligned, AgreementTimeout

    last = world - 1
    everyone = list(range(world))
    # 1. Created on rank 0 only (a detector on rank 0 only, through agree()): rank 0 gets a clear
    # error after its timeout, no collective ran, and the other ranks' all_reduce meets rank 0's
    # next one, correctly summed. A rank that creates it late is told at once.
    if rank == 0:
        with pytest.raises(AgreementTimeout, match="never created it") as caught:
            distributed.agree(True, timeout=1.5)
        assert f"rank(s) {1 if world == 2 else '1-2'} never" in str(caught.value)
        assert 1.4 <= _waited(caught.value) < 15, str(caught.value)
        _model_all_reduce(rank, world)
    else:
        _model_all_reduce(rank, world)
        with pytest.raises(AgreementError, match="given up.*rank 0 waited"):
            Agreement(timeout=20)
    # 2. Created on every rank: agreements interleaved with the model's all_reduce.
    agreement = Agreement(timeout=20)
    assert agreement.agree(rank == last) == [last]
    _model_all_reduce(rank, world)
    assert agreement.agree(False) == []
    assert agreement.agree(True) == everyone
    _model_all_reduce(rank, world)
    with distributed.local_only():  # no collective, no sequence number taken
        assert agreement.agree(rank == 0) == ([0] if rank == 0 else [])
    assert agreement.agree(rank in (0, last), seq=10) == [0, last]
    assert agreement.seq == 10
    # 3. Rank 0 skips agreement point 11: every rank raises, naming the points; nothing decided.
    with pytest.raises(AgreementMisaligned) as caught:
        agreement.agree(True, seq=12 if rank == 0 else 11)
    others = "1" if world == 2 else "1-2"
    assert f"rank(s) {others} at agreement 11; rank(s) 0 at agreement 12" in str(caught.value), str(caught.value)
    with pytest.raises(AgreementError, match="unusable"):
        agreement.agree(True)
    _model_all_reduce(rank, world)
    # 4. A caught timeout: the last rank comes late to agreement 1. It never gets a decision
    # (no false detection from the abandoned call), the object is unusable on every rank, and a
    # new Agreement agrees correctly from its first call on (no off-by-one).
    dist.barrier()  # the ranks create it together: its timeout is short
    short = Agreement(timeout=2)
    if rank != last:
        with pytest.raises(AgreementTimeout) as caught:
            short.agree(False)
        assert 1.9 <= _waited(caught.value) < 20, str(caught.value)
        assert f"waited {_waited(caught.value):.2f} s at agreement 1 for rank(s)" in str(caught.value)
        dist.barrier()
    else:
        dist.barrier()  # after the others gave up
        with pytest.raises(AgreementError, match="gave up agreement 1"):
            short.agree(True)
    with pytest.raises(AgreementError, match="unusable"):
        short.agree(True)
    fresh = Agreement(timeout=20)
    assert fresh.agree(rank == last) == [last]
    assert fresh.agree(False) == []
    _model_all_reduce(rank, world)
    # agree() drops its Agreement after an error: the next call creates a new one on every rank
    assert distributed.agree(rank == 0, timeout=20) == [0]
    assert distributed.agree(False, timeout=20) == []


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_agreement_has_its_own_group_and_numbered_calls(world):
    run_ranks(_agreement_worker, world, world=world, timeout=90)
