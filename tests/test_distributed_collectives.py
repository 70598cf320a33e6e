"""Collectives and the detector (2 processes, gloo, CPU): a tensor that an in-place collective
writes is read again after the write (never a stale row), and a replay never communicates."""

import contextlib
import io
import re

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
    other = 1 - rank
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
                report = got.split("Source:")[0]
                assert report.rstrip("\n") == want.rstrip("\n"), (name, kind, got, want)
            if kind == "watch":
                assert "Source: born in forward of 0 (Written): output from finite inputs and weights\n" in got, \
                    (name, got)


def test_an_in_place_collective_is_seen_as_a_write_by_every_detector():
    run_ranks(_writes_worker, timeout=240)


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
            assert f"Op: not replayed (the call communicates across ranks: {op} at {__file__}:" in out.getvalue(), \
                (op, out.getvalue())
        # the next collective of the job pairs with the other rank's next one, not with a replay's
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0, (op, total)


def test_a_replay_never_communicates_and_every_rank_stops_together():
    run_ranks(_replays_worker, timeout=120)
