"""Collectives and the detector (2 processes, gloo, CPU): a tensor that an in-place collective
writes is read again after the write (never a stale row), and a replay never communicates."""

import contextlib
import io
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_imported_early

from test_distributed import run_ranks

PREFIX = re.compile(r"^\[rank (\d)/2\] ", re.M)
INF = float("inf")


def _attach(kind, model):
    from transformers.debug_utils import DebugUnderflowOverflow as Reference

    from overflow_fast import DebugUnderflowOverflow, watch

    if kind == "reference":
        return Reference(model)
    if kind == "reference traced":
        return Reference(model, trace_batch_nums=[0])
    if kind == "drop-in":
        return DebugUnderflowOverflow(model)
    if kind == "drop-in traced":
        return DebugUnderflowOverflow(model, trace_batch_nums=[0])
    if kind == "batch":
        return DebugUnderflowOverflow(model, check="batch")
    if kind == "watch deferred":
        return watch(model, sync_timeout=20, defer=True)
    return watch(model, sync_timeout=20)


def _forward(kind, model, x):
    """One forward with a detector of ``kind``: (stdout without rank prefixes, the error or None)."""
    detector = _attach(kind, model)
    out = io.StringIO()
    error = None
    with contextlib.redirect_stdout(out):
        try:
            model(x)
        except ValueError as caught:
            error = caught
    if hasattr(detector, "remove"):
        detector.remove()
    return PREFIX.sub("", out.getvalue()), error


@pytest.fixture
def one_rank():
    """A process group of this process alone (gloo): collectives run, and return at once."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_in_place_collectives_bump_the_version_of_what_they_write_while_held(one_rank):
    from overflow_fast.distributed import seen_as_writes

    tensor, out = torch.ones(4), torch.empty(4)
    held = seen_as_writes()
    try:
        for write in (lambda: dist.all_reduce(tensor), lambda: all_reduce_imported_early(tensor),
                      lambda: dist.broadcast(tensor, src=0), lambda: one_rank.allreduce([tensor]).wait(),
                      lambda: dist.all_reduce(tensor, async_op=True).wait()):
            before = tensor._version
            write()
            assert tensor._version > before
        before = out._version
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its name from 2.13
        gather(out, tensor)  # the output is written, the input only read
        assert out._version > before
        assert tensor.tolist() == [1.0] * 4
    finally:
        held.release()
    before = tensor._version
    dist.all_reduce(tensor)  # released: as without a detector
    assert tensor._version == before
    with torch.inference_mode():  # no version counter: nothing to bump, and nothing fails
        inference = torch.ones(2)
    held = seen_as_writes()
    dist.all_reduce(inference)
    del held  # collected: as released
    dist.all_reduce(tensor)
    assert tensor._version == before


def test_no_communication_refuses_every_collective_before_it_runs(one_rank):
    import torch.distributed._functional_collectives as functional

    from overflow_fast.distributed import CommunicationRefused, NoCommunication, communicating

    assert communicating(torch.ops.c10d.allreduce_.default) == "c10d.allreduce_"
    assert communicating(torch.ops._c10d_functional.all_gather_into_tensor.default) == \
        "_c10d_functional.all_gather_into_tensor"
    assert communicating(torch.ops._c10d_functional.wait_tensor.default) is None  # sends nothing
    assert communicating(torch.ops.aten.add.Tensor) is None
    tensor = torch.ones(4)
    with NoCommunication() as guard:
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        except CommunicationRefused:
            pass  # code that swallows it: the guard still knows
        assert tensor._version == 0  # stopped before it ran (it would have bumped the version)
        with pytest.raises(CommunicationRefused, match="_c10d_functional.all_reduce"):
            functional.all_reduce(tensor, "sum", one_rank)  # DTensor's redistribution calls these
    assert guard.refused == "c10d.allreduce_"
    work = dist.all_reduce(tensor, async_op=True)  # outside the guard, collectives run again
    assert work.wait() and tensor.tolist() == [1.0] * 4


def test_a_replay_of_a_call_that_communicates_says_so(one_rank):
    from overflow_fast.replay.op_replay import replay_backward, replay_forward

    class Reduces(torch.nn.Module):
        def forward(self, x):
            x = x * 2
            dist.all_reduce(x)
            return x

    line = Reduces.forward.__code__.co_firstlineno + 2
    why = f"not replayed (the call communicates across ranks: c10d.allreduce_ at {__file__}:{line})"
    assert replay_forward(Reduces(), (torch.ones(2),)) == {"op": None, "phase": "forward", "why": why}
    x = torch.ones(2, requires_grad=True)
    assert replay_backward(Reduces(), (x,), {}, [torch.ones(2)]) == {"op": None, "phase": "backward", "why": why}

    class ReduceGradient(torch.autograd.Function):  # tensor parallelism's "copy to the region"
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, gradient):
            gradient = gradient.clone()
            dist.all_reduce(gradient)
            return gradient

    class Copies(torch.nn.Module):
        def forward(self, x):
            return ReduceGradient.apply(x) * 2

    result = replay_backward(Copies(), (x,), {}, [torch.ones(2)])
    line = ReduceGradient.backward.__code__.co_firstlineno + 3
    assert result == {"op": None, "phase": "backward", "why": "not replayed (the call communicates across ranks: "
                      f"c10d.allreduce_ at {__file__}:{line})"}, result


# -- writes: every in-place collective is seen --------------------------------------------------


class Written(torch.nn.Module):
    """``h = self.fc(x)`` (4e4 everywhere, finite in fp16), then ``write(h)``: a collective that
    writes ``h`` in place, making it inf on the ranks the case names. No gradient: gloo's
    all_gather_into_tensor cannot write a tensor that requires one."""

    def __init__(self, write):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, bias=False).half().requires_grad_(False)
        with torch.no_grad():
            self.fc.weight.fill_(1e4)
        self.write = write

    def forward(self, x):
        h = self.fc(x)
        self.write(h)
        return h


def _inf_like(h):
    return torch.full_like(h, INF)


def _writes(rank):
    """(name, write(h), the ranks where ``h`` turns inf through the collective alone)."""
    world = dist.group.WORLD

    def broadcast(h):
        if rank == 1:
            h.mul_(2)  # inf in place on rank 1 (a torch op: it bumps the version itself)
        dist.broadcast(h, src=1)

    def recv(h, asynchronous=False):
        if rank == 1:
            dist.send(_inf_like(h), dst=0)
        elif asynchronous:
            dist.irecv(h, src=1).wait()
        else:
            dist.recv(h, src=1)

    def all_gather_into(h, gather):
        part = _inf_like(h[:1]) if rank == 1 else h[:1].clone()
        gather(h, part)

    def all_gather_list(h):
        part = _inf_like(h) if rank == 1 else h.clone()
        dist.all_gather([torch.empty_like(h), h] if rank == 0 else [h.clone(), h.clone()], part)

    def scatter(h):
        dist.scatter(h, [_inf_like(h), _inf_like(h)] if rank == 1 else None, src=1)

    def gather(h):
        dist.gather(_inf_like(h) if rank == 1 else h.clone(), [torch.empty_like(h), h] if rank == 0 else None, dst=0)

    def all_to_all(h):
        source = _inf_like(h) if rank == 1 else h.clone()
        dist.all_to_all_single(h, source)

    cases = [
        ("all_reduce", lambda h: dist.all_reduce(h), [0, 1]),
        ("all_reduce async", lambda h: dist.all_reduce(h, async_op=True).wait(), [0, 1]),
        ("all_reduce imported before the detector", lambda h: all_reduce_imported_early(h), [0, 1]),
        ("ProcessGroup.allreduce", lambda h: world.allreduce([h]).wait(), [0, 1]),
        ("broadcast", broadcast, [0]),
        ("reduce", lambda h: dist.reduce(h, dst=0), [0]),
        ("recv", recv, [0]),
        ("irecv", lambda h: recv(h, asynchronous=True), [0]),
        ("all_to_all_single", all_to_all, [0]),
        ("all_gather_into_tensor", lambda h: all_gather_into(h, dist.all_gather_into_tensor), [0, 1]),
        ("all_gather", all_gather_list, [0]),
        ("scatter", scatter, [0]),
        ("gather", gather, [0]),
        ("reduce_scatter_tensor", lambda h: dist.reduce_scatter_tensor(h, torch.cat([h, h])), [0, 1]),
        ("reduce_scatter_tensor async",
         lambda h: dist.reduce_scatter_tensor(h, torch.cat([h, h]), async_op=True).wait(), [0, 1]),
    ]
    for legacy in ("_all_gather_base", "all_gather_single"):  # names of all_gather_into_tensor
        if hasattr(dist, legacy):
            cases.append((legacy, lambda h, gather=getattr(dist, legacy): all_gather_into(h, gather), [0, 1]))
    if hasattr(dist, "_reduce_scatter_base"):
        cases.append(("_reduce_scatter_base", lambda h: dist._reduce_scatter_base(h, torch.cat([h, h])), [0, 1]))
    return cases


def _writes_worker(rank):
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # the legacy names are deprecated
    x = torch.ones(2, 4, dtype=torch.float16)
    for name, write, ranks in _writes(rank):
        def run(kind):
            model = torch.nn.Sequential(Written(write), torch.nn.ReLU())
            return _forward(kind, model, x)

        # every rank runs every forward: each runs the case's collective
        # traced: every frame, the ReLU's input too, as the reference prints it
        want, _ = run("reference traced")
        got, _ = run("drop-in traced")
        if rank in ranks:
            assert "4.00e+04 4.00e+04 output\n" in got and "      inf input[0]\n" in got.split("1 ReLU")[1], (name, got)
            assert got == want, (name, got, want)
        want, error = run("reference")  # it raises at the layer's output
        if rank in ranks:
            assert error is not None and want.rstrip("\n").endswith("      inf output"), (name, want)
            assert want.rstrip("\n").split("\n")[-3].endswith("0 Written"), (name, want)
        for kind in ("drop-in", "batch", "watch"):
            got, error = run(kind)
            # every rank stops; a rank may also detect where the collective is not the only writer
            # (broadcast's source made its inf itself, gloo's reduce writes partial sums elsewhere)
            assert error is not None and set(ranks) <= set(error.ranks), (name, kind, error, got)
            if rank not in ranks:
                continue
            if kind == "drop-in":
                assert got == want, (name, got, want)
            else:
                report = re.split(r"\n(?:Where|Source): ", got)[0]
                assert report.rstrip("\n") == want.rstrip("\n"), (name, kind, got, want)
            if kind == "watch":
                assert "Source: born in forward of 0 (Written): output from finite inputs and weights\n" in got, \
                    (name, got)


def test_an_in_place_collective_is_seen_as_a_write_by_every_detector():
    run_ranks(_writes_worker, timeout=240)


def _deferred_worker(rank):
    from overflow_fast import OverflowDetected, watch

    writes = []  # the layer's all_reduce runs from the second forward on only

    def write(h):
        if writes:
            dist.all_reduce(h)

    model = torch.nn.Sequential(Written(write), torch.nn.ReLU())
    # the accelerators' deferral (OVERFLOW_FAST_CPU_AS_DEVICE=1): fc's output, seen unchanged at the
    # end of the first forward, waits for the end of the second; the all_reduce changes it before
    # that, so it is never read after the write (nor blamed for the sum's inf)
    detector = watch(model, defer=True, sync_timeout=20)
    x = torch.ones(2, 4, dtype=torch.float16)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model(x)
        writes.append(True)
        with pytest.raises(OverflowDetected) as caught:
            model(x)
    detector.remove()
    got = PREFIX.sub("", out.getvalue())
    assert caught.value.ranks == [0, 1], got
    assert "Source: born in forward of 0 (Written): output from finite inputs and weights\n" in got, got


def test_a_read_that_waits_is_never_taken_after_a_collective_wrote_the_tensor():
    run_ranks(_deferred_worker, timeout=60)


# -- async collectives: written when their work completes -----------------------------------------


class RowParallel(torch.nn.Module):
    """A tensor-parallel row layer: ``h = fc(x)`` (4e4 everywhere, finite in fp16), then the sum of
    ``h`` over the ranks (inf in fp16) issued with ``async_op=True``; it returns ``h`` while the
    work is in flight, or waits at once. Rank 0 issues its part late, so rank 1's work cannot
    complete before rank 1's hooks read ``h``."""

    def __init__(self, rank, wait_at_once):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, bias=False).half().requires_grad_(False)
        with torch.no_grad():
            self.fc.weight.fill_(1e4)
        self.rank, self.wait_at_once = rank, wait_at_once
        self.work = None

    def forward(self, x):
        h = self.fc(x)
        if self.rank == 0:
            time.sleep(0.3)
        self.work = dist.all_reduce(h, async_op=True)
        if self.wait_at_once:
            self.work.wait()
        return h


class WaitsLater(torch.nn.Module):
    """The parent waits for the row layer's work, then feeds the now-inf ``h`` to the next module."""

    def __init__(self, rank, wait_at_once):
        super().__init__()
        self.row = RowParallel(rank, wait_at_once)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        h = self.row(x)
        self.row.work.wait()
        return self.act(h)


def _async_worker(rank):
    x = torch.ones(2, 4, dtype=torch.float16)
    for wait_at_once in (False, True):
        def run(kind):
            return _forward(kind, WaitsLater(rank, wait_at_once), x)

        want, error = run("reference")
        last = want.rstrip("\n").split("\n")
        if rank == 1:  # (rank 0's work may complete before its hook reads h)
            if wait_at_once:
                assert last[-1].endswith("      inf output") and last[-3].endswith("row RowParallel"), want
            else:
                # the next module's input[0] has infs, the row layer's output read before the write
                assert want.startswith("input[0] has infs\n") and last[-2].endswith("      inf input[0]"), want
                assert last[-3].endswith("act ReLU") and "4.00e+04 4.00e+04 output" in want, want
        for kind in ("drop-in", "batch", "watch", "watch deferred"):
            got, error = run(kind)
            assert error is not None and 1 in error.ranks, (wait_at_once, kind, error, got)
            if rank != 1:
                continue
            report = re.split(r"\n(?:Where|Source|Op): ", got)[0]
            assert report.rstrip("\n") == want.rstrip("\n"), (wait_at_once, kind, got, want)


def test_an_async_collective_writes_when_its_work_completes():
    """Waited later (the parent waits, then the next module takes the now-inf h) as the reference
    sees it: the version bumped when the op returned, a row read of h before its work wrote it is
    never reused after; and waited at once."""
    run_ranks(_async_worker, timeout=240)


def test_nothing_is_in_flight_once_its_work_completes(one_rank):
    from overflow_fast.distributed import IN_FLIGHT, in_flight, seen_as_writes

    held = seen_as_writes()
    try:
        h = torch.ones(4)
        view = h[1:]
        work = dist.all_reduce(h, async_op=True)
        work.wait()
        assert in_flight([h, view, torch.ones(2)]) == [] and not IN_FLIGHT  # completed: forgotten
    finally:
        held.release()
    assert not IN_FLIGHT


# -- a replay never communicates -----------------------------------------------------------------


class Communicates(torch.nn.Module):
    """A block whose forward runs ``communicate(h)`` (a collective, every rank), then an op that
    makes a nan on rank 1 only: there only, the detector replays the call."""

    def __init__(self, communicate, rank):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.communicate = communicate
        self.shift = 10.0 if rank == 1 else -10.0

    def forward(self, x):
        h = self.communicate(self.fc(x))
        return torch.sqrt(h.abs() - self.shift)  # nan where |h| < shift: on rank 1 only


def _replays_worker(rank):
    from torch.distributed.tensor import DTensor, Partial, Replicate, init_device_mesh

    from overflow_fast import OverflowDetected, watch

    mesh = init_device_mesh("cpu", (2,))

    def all_reduce(h):
        h = h.clone()
        dist.all_reduce(h)
        return h

    cases = [
        ("c10d.allreduce_", all_reduce),
        ("_c10d_functional.all_reduce",  # a DTensor's redistribution
         lambda h: DTensor.from_local(h, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()),
    ]
    for op, communicate in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(Communicates(communicate, rank), torch.nn.Linear(4, 2))
        detector = watch(model, sync_timeout=20)
        out = io.StringIO()
        stopped = None
        with contextlib.redirect_stdout(out):
            for step in range(2):
                try:
                    model(torch.randn(3, 4)).sum().backward()
                except OverflowDetected as error:
                    stopped = (step, error.ranks)
                    break
        detector.remove()
        # every rank stops at once, as without find_op; rank 1 says why it did not replay
        assert stopped == (0, [1]), (op, stopped, out.getvalue())
        if rank == 1:
            ops = [line for line in out.getvalue().splitlines() if "Op:" in line]
            assert len(ops) == 1 and re.fullmatch(  # what the collective reads is finite: nothing more
                rf"\[rank 1/2\] Op: not replayed \(the call communicates across ranks: {re.escape(op)} at "
                rf"{re.escape(__file__)}:\d+\)",
                ops[0]), (op, ops)
        # the next collective of the job pairs with the other rank's next one, not with a replay's
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0, (op, total)


@pytest.mark.one_path  # find_op's replay and the ranks' agreement; the reads before them: the tests above
def test_a_replay_never_communicates_and_every_rank_stops_together():
    run_ranks(_replays_worker, timeout=120)


class Exp(torch.nn.Module):
    """``exp(fc(x) * 100)``: inf where ``fc``'s output passes 0.9 (fp32), in its own code."""

    def __init__(self, out_features=4):
        super().__init__()
        self.fc = torch.nn.Linear(4, out_features)

    def forward(self, x):
        return torch.exp(self.fc(x) * 100)


def _sharded_replays_worker(rank, repro):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from overflow_fast import OverflowDetected, watch

    mesh = init_device_mesh("cpu", (2,))

    def run(model, x):
        detector = watch(model, sync_timeout=20, repro=repro)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.warns(RuntimeWarning) if rank == 1 else contextlib.nullcontext() \
                as warned:
            with pytest.raises(OverflowDetected) as caught:
                model(x).sum().backward()
        detector.remove()
        if rank == 1:  # no reproducer: it would need the other ranks
            messages = [str(warning.message) for warning in warned]
            assert any("cannot write the reproducer" in message and ("DTensors" in message or "FSDP2" in message)
                       for message in messages), messages
        ops = [line for line in out.getvalue().splitlines() if "Op:" in line]
        return caught.value.ranks, ops

    # tensor parallelism: fc's weight rows 2 and 3 (rank 1's shard) make the inf; the replay runs
    # on the local shards, as the call did, and names the op on rank 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(Exp(), torch.nn.ReLU())
    with torch.no_grad():
        model[0].fc.weight[2:] += 1
    parallelize_module(model[0], mesh, {"fc": ColwiseParallel()})
    ranks, ops = run(model, torch.ones(3, 4))
    assert ranks == [1], (ranks, ops)
    if rank == 1:
        line = Exp.forward.__code__.co_firstlineno + 1
        assert len(ops) == 1, ops
        assert ops[0].startswith(f"[rank 1/2] Op: aten.exp at {__file__}:{line}: inf from finite"), ops

    # a tensor-parallel block (colwise, then rowwise: an all_reduce): the replay stops at the
    # all_reduce, and says what it had seen before it
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.out(torch.exp(self.fc(x) * 100))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), torch.nn.ReLU())
    with torch.no_grad():
        model[0].fc.weight += 1
    parallelize_module(model[0], mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    ranks, ops = run(model, torch.ones(3, 4))
    line = Block.forward.__code__.co_firstlineno + 1
    assert ranks == [0, 1] and len(ops) == 1, (ranks, ops)
    where = re.escape(f"{__file__}:{line}")
    # the nan/inf is in out's input: the replay of Block ends at out's call, before its all_reduce
    assert re.fullmatch(rf"\[rank {rank}/2\] Op: aten\.exp at {where}: inf from finite inputs "
                        r"\(input abs max [^)]*\); reproduced on the same inputs", ops[0]), ops

    # FSDP2: the parameters are sharded again after each call; the line says why there is no replay,
    # and with reshard_after_forward=False the call replays
    for reshard in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Exp(), torch.nn.Linear(4, 2))
        fully_shard(model[0], mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        ranks, ops = run(model, torch.ones(3, 4) * (10.0 if rank == 1 else 0.0))
        assert ranks == [1], (reshard, ranks, ops)
        if rank == 1 and reshard:
            assert ops == ["[rank 1/2] Op: not replayed (the parameters of fc are sharded across ranks, and gathering "
                           "them would communicate: FSDP2 gathers them for each call only, unless "
                           "reshard_after_forward=False)"], ops
        elif rank == 1:
            assert len(ops) == 1 and ops[0].startswith(f"[rank 1/2] Op: aten.exp at {__file__}:"), ops


@pytest.mark.one_path  # find_op's replay on shards; the reads that lead to it: the tests above
def test_under_tensor_parallelism_and_fsdp2_a_replay_runs_on_local_shards_or_says_why_not(tmp_path):
    run_ranks(_sharded_replays_worker, str(tmp_path), timeout=120)
