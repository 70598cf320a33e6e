"""The detector under torch.distributed (2 processes, gloo, CPU): rank-aware reports, every rank
stopping together at the same step, and whole-tensor numbers for sharded parameters (FSDP2 before
and after sharding, tensor parallel, DeepSpeed ZeRO-3), equal to an unsharded single-process run."""

import contextlib
import io
import os
import re

import pytest
import torch

from test_distributed import WORLD, run_ranks

PREFIX = re.compile(r"^\[rank (\d)/2\] ", re.M)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4, bias=False),
                               torch.nn.LayerNorm(4))


def _batch(step, rank=0):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _run(model, steps, train, **options):
    """Attach the detector, run ``steps(step)`` -> batch; returns (stdout, step it stopped at, error)."""
    from overflow_fast import DebugUnderflowOverflow, watch

    attach = watch if options.pop("watch", False) else DebugUnderflowOverflow
    detector = attach(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    stopped = (None, None)
    with contextlib.redirect_stdout(out):
        for step in range(4):
            try:
                batch = steps(step)
                if train:
                    model(batch).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                else:
                    with torch.no_grad():
                        model(batch)
            except ValueError as error:
                stopped = (step, error)
                break
    detector.remove()
    return out.getvalue(), stopped[0], stopped[1]


def _ddp_worker(rank):
    from torch.nn.parallel import DistributedDataParallel

    from overflow_fast import OverflowDetected

    for options in (dict(check="module"), dict(check="batch"), dict(watch=True), dict(watch=True, check="module")):
        model = _model()
        ddp = DistributedDataParallel(model)

        def steps(step):
            batch = _batch(step, rank)
            if step == 2 and rank == 1:
                batch[0, 0] = float("nan")
            return batch

        out, step, error = _run(ddp, steps, True, **dict(options))
        # both ranks stop at step 2, in that forward, naming rank 1; none trains on or hangs
        assert step == 2, (options, step, out)
        assert isinstance(error, OverflowDetected) and error.ranks == [1], (options, error)
        assert str(error).startswith("DebugUnderflowOverflow: inf/nan detected on rank(s) 1, aborting")
        if rank == 1:
            lines = out.splitlines()
            assert lines and all(PREFIX.match(line) for line in lines), out
            assert "[rank 1/2] input[0] has nans" in lines and "[rank 1/2] Detected inf/nan during batch_number=2" \
                in lines, out
        else:
            assert out == "", out  # rank 0 saw nothing: it stops because rank 1 did


def test_ddp_nan_on_one_rank_stops_every_rank_at_the_same_step_in_every_mode():
    run_ranks(_ddp_worker, timeout=120)


def _unsharded_trace(poison=None):
    """The trace of batch 0 of the unsharded model in this process, without rank prefixes."""
    model = _model()
    if poison is not None:
        poison(model)
    out, _, _ = _run(model, lambda step: _batch(0), False, check="batch", trace_batch_nums=[0])
    return PREFIX.sub("", out)  # run inside a rank: its lines carry the rank too


def _fsdp_worker(rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    from overflow_fast import OverflowDetected

    mesh = init_device_mesh("cpu", (WORLD,))
    want = _unsharded_trace()

    def sharded():
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    for attach_before, check in ((True, "module"), (False, "module"), (False, "batch"), (True, "batch")):
        if attach_before:
            from overflow_fast import DebugUnderflowOverflow
            model = _model()
            detector = DebugUnderflowOverflow(model, check=check, trace_batch_nums=[0])
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            out = io.StringIO()
            with contextlib.redirect_stdout(out), torch.no_grad():
                model(_batch(0))  # the same batch on every rank: the same numbers as unsharded
            detector.remove()
            out = out.getvalue()
        else:
            out, _, _ = _run(sharded(), lambda step: _batch(0), False, check=check, trace_batch_nums=[0])
            out = out.split("*** Starting batch number=1 ***")[0].rsplit("\n", 2)[0] + "\n"
            want_cut = want.split("*** Starting batch number=1 ***")[0].rsplit("\n", 2)[0] + "\n"
        got = PREFIX.sub("", out)
        expected = want if attach_before else want_cut
        assert got.startswith(expected[:len(got)]) and len(got) > 200, (attach_before, check, got, expected)
        assert "weight" in got

    # an inf in rank 1's shard of a weight: every rank sees the whole tensor, and all stop together
    def poison(model):
        with torch.no_grad():
            local = model[2].weight.to_local()
            if rank == 1:
                local[0, 0] = float("inf")

    for check in ("module", "batch"):
        model = sharded()
        poison(model)
        out, step, error = _run(model, lambda step: _batch(step), False, check=check)
        assert step == 0 and isinstance(error, OverflowDetected) and error.ranks == [0, 1], (check, error, out)
        assert f"[rank {rank}/2] weight has infs" in out, out
        assert f"[rank {rank}/2] weight has them in the shard of rank(s) 1" in out, out  # whose shard


def test_fsdp2_numbers_equal_an_unsharded_run_and_a_shard_inf_stops_every_rank():
    run_ranks(_fsdp_worker, timeout=120)


def _tensor_parallel_worker(rank):
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from overflow_fast import OverflowDetected

    mesh = init_device_mesh("cpu", (WORLD,))

    def parallel():
        model = _model()
        # layer 0: weight Shard(0) (column-wise); layer 2: weight Shard(1) (row-wise)
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    want = _unsharded_trace()
    out, _, _ = _run(parallel(), lambda step: _batch(0), False, check="batch", trace_batch_nums=[0])
    got = PREFIX.sub("", out)
    for name in ("0 Linear", "2 Linear"):
        frame_want = want.split(f"                  {name}\n")[1].split("\n")[0]
        frame_got = got.split(f"                  {name}\n")[1].split("\n")[0]
        assert frame_got == frame_want, (name, frame_got, frame_want)  # the weight: whole-tensor numbers

    model = parallel()
    with torch.no_grad():
        if rank == 1:
            model[2].weight.to_local()[0, 0] = float("nan")
    out, step, error = _run(model, lambda step: _batch(0), False, check="module")
    assert step == 0 and isinstance(error, OverflowDetected) and error.ranks == [0, 1], (error, out)
    assert f"[rank {rank}/2] weight has nans" in out
    assert f"[rank {rank}/2] weight has them in the shard of rank(s) 1" in out, out


def test_tensor_parallel_linear_shows_whole_weights_and_stops_every_rank():
    run_ranks(_tensor_parallel_worker, timeout=120)


def _zero3_worker(rank):
    # what a launcher sets for DeepSpeed
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_SIZE=str(WORLD))
    import deepspeed

    from overflow_fast import OverflowDetected

    deepspeed.init_distributed(dist_backend="gloo")  # joins the process group already there
    want = _unsharded_trace()
    config = {"train_batch_size": 2, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              # partition every parameter, however small
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    def engine():
        model = _model()
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    for check in ("module", "batch"):
        # attached after initialize: outside its module's forward a parameter is an empty
        # placeholder, its values in one partition per rank
        out, _, _ = _run(engine().module, lambda step: _batch(0), False, check=check, trace_batch_nums=[0])
        got = PREFIX.sub("", out).split("*** Starting batch number=1 ***")[0]
        assert got == want.split("*** Starting batch number=1 ***")[0], (check, got, want)

    model = engine().module
    with torch.no_grad():
        if rank == 1:
            model[2].weight.ds_tensor[0] = float("inf")  # the first element of rank 1's partition
    out, step, error = _run(model, lambda step: _batch(0), False, check="batch")
    assert step == 0 and isinstance(error, OverflowDetected) and error.ranks == [0, 1], (error, out)
    assert f"[rank {rank}/2] weight has them in the shard of rank(s) 1" in out, out


@pytest.mark.slow  # DeepSpeed takes a minute to import in each rank
def test_deepspeed_zero3_partitions_read_as_whole_parameters():
    pytest.importorskip("deepspeed")
    run_ranks(_zero3_worker, timeout=400)  # the first run JIT-builds a DeepSpeed C++ op


# -- one detection, one report; the agreement never meets the model's collectives ----------------

def _one_report_worker(rank, log_dir):
    import json

    from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

    for name, attach in (("batch", lambda m, **k: DebugUnderflowOverflow(m, check="batch", **k)),
                         ("watch", watch), ("module", lambda m, **k: DebugUnderflowOverflow(m, **k))):
        model = _model()
        log = os.path.join(log_dir, f"{name}.jsonl")
        detector = attach(model, log=log)
        out = io.StringIO()
        error = None
        with contextlib.redirect_stdout(out):
            for step in range(3):
                batch = _batch(step, rank)
                if rank == 0 and step == 1:
                    batch[:, 0] = float("nan")  # every later frame carries it too
                try:
                    model(batch).sum().backward()
                except OverflowDetected as caught:
                    error = caught
                    break
        detector.remove()
        assert step == 1 and error is not None and error.ranks == [0], (name, step, error)
        text = out.getvalue()
        if rank == 0:
            assert text.count("Detected inf/nan") == 1, (name, text)
            assert len(detector.detections) == 1, (name, detector.detections)
            with open(os.path.join(log_dir, f"{name}.rank0.jsonl")) as f:
                records = [json.loads(line) for line in f]
            assert sum(r["record"] == "detection" for r in records) == 1, name
        else:
            assert text == "" and detector.detections == [], (name, text)


def test_one_detection_gives_one_report_one_entry_and_one_record(tmp_path):
    run_ranks(_one_report_worker, str(tmp_path), timeout=120)


def _one_rank_only_worker(rank):
    import torch.distributed as dist

    from overflow_fast import DebugUnderflowOverflow
    from overflow_fast.distributed import AgreementTimeout

    model = _model()
    if rank == 0:  # a detector on rank 0 only (to avoid duplicate prints, say)
        with pytest.raises(AgreementTimeout, match="rank") as caught:
            DebugUnderflowOverflow(model, check="batch", sync_timeout=2)
        assert "waited" in str(caught.value)
    gradient = torch.tensor([1.5, 2.5]) * (rank + 1)
    dist.all_reduce(gradient)  # the model's own collective: summed, never paired with the detector's
    assert gradient.tolist() == [4.5, 7.5], gradient


def test_a_detector_on_one_rank_only_fails_there_and_never_meets_the_models_collective():
    run_ranks(_one_rank_only_worker, timeout=60)


def _raised_forward_worker(rank):
    from overflow_fast import watch
    from overflow_fast.distributed import AgreementMisaligned

    class MayFail(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model()

        def forward(self, x, fail):
            y = self.inner(x)
            if fail:
                raise RuntimeError("this rank's forward failed")
            return y

    model = MayFail()
    watch(model, sync_timeout=20)  # agreements at the end of every forward and every backward
    outcomes = []
    for step in range(3):
        try:
            model(_batch(step, rank), fail=(rank == 1 and step == 1)).sum().backward()
            outcomes.append(None)
        except AgreementMisaligned as error:
            outcomes.append(str(error))
            break
        except RuntimeError as error:  # the loop catches it and goes on: rank 1 skips a backward
            outcomes.append(type(error).__name__)
    assert outcomes[-1] is not None and "agreement" in outcomes[-1], outcomes
    assert "rank(s) 0" in outcomes[-1] and "rank(s) 1" in outcomes[-1], outcomes


def test_a_rank_that_skips_an_agreement_gets_an_error_naming_the_ranks_on_every_rank():
    run_ranks(_raised_forward_worker, timeout=90)


def _three_ranks_worker(rank):
    from overflow_fast import OverflowDetected, watch

    model = _model()
    detector = watch(model)
    stopped = None
    for step in range(3):
        batch = _batch(step, rank)
        if rank == 2 and step == 1:
            batch[1, 1] = float("inf")
        try:
            model(batch).sum().backward()
        except OverflowDetected as error:
            stopped = (step, error.ranks)
            break
    detector.remove()
    assert stopped == (1, [2]), stopped


@pytest.mark.slow  # three ranks (two: the tests above); .ci/run runs it
def test_three_ranks_stop_together():
    run_ranks(_three_ranks_worker, timeout=90, world=3)


def _sharded_grad_scaler_worker(rank):
    # FSDP's ShardedGradScaler (its own scale() and update()) under DDP, fp16 autocast on CPU: every
    # rank's inf gradients are the scaler's backoffs (its found_inf is all-reduced), one line each
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel

    from overflow_fast import watch

    ddp = DistributedDataParallel(_model())
    detector = watch(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 30)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(4):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ddp(_batch(step, rank)).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    detector.remove()
    lines = out.getvalue().splitlines()
    backoff = f"[rank {rank}/2] GradScaler backoff in the backward of batch_number="
    assert len(lines) == 4 and all(line.startswith(backoff) for line in lines), lines
    assert scaler.get_scale() == 2.0 ** 26


def test_sharded_grad_scaler_backoffs_under_ddp():
    run_ranks(_sharded_grad_scaler_worker)
