"""Per-step cost of the distributed coordination: an agreement (``Agreement.agree()``: one
all_reduce of world_size x 4 int64 on its own gloo group, and ``agree()``, the same through the
Agreement it keeps) and ``global_rows()`` (one all_gather of the DTensor rows of a read), on gloo
with 2 CPU processes, side by side with a no-op call and the bare collectives; and what a
detector adds to the model's own in-place collectives (``seen_as_writes``: a kernel that bumps the
version counters of what they write), also measured first in this one process (a group of one
rank: the collective's own cost without the network, so the kernel's stands out).

    python benchmarks/bench_distributed.py [--calls N] [--rounds R]

Rank 0 prints the medians over rounds (each round times N calls of each variant, round-robin).
"""

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from overflow_fast import distributed, tensor_stats
from overflow_fast.distributed import shards


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WRITES_SEEN = "dist.all_reduce (2 int32), a detector attached (seen as a write)"


def _noop(detected):
    return [] if not detected else [0]


def _worker(rank, port, calls, rounds):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    params = [distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)]) for _ in range(8)]
    local = tensor_stats(params).values
    flags = torch.zeros(2, dtype=torch.int32)
    rows = torch.zeros(16, 8, dtype=torch.int64)
    agreement = distributed.Agreement(timeout=60)
    variants = {
        "no-op call": lambda: _noop(False),
        "bare dist.all_reduce (2 int32)": lambda: dist.all_reduce(flags),
        WRITES_SEEN: lambda: dist.all_reduce(flags),
        "bare all_gather (8x8 int64 per rank)": lambda: shards._all_gather_single(dist)(rows, local),
        "Agreement.agree() (own gloo group, 2x4 int64)": lambda: agreement.agree(False),
        "agree() (its Agreement)": lambda: distributed.agree(False),
        "global_rows() of 8 DTensors (all_gather 8x8 int64)": lambda: distributed.global_rows(local, params),
        "global_rows() + host read": lambda: distributed.global_rows(local, params).tolist(),
    }
    times = {name: [] for name in variants}
    for name, fn in variants.items():  # warm up
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            held = distributed.seen_as_writes() if name == WRITES_SEEN else None
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
            if held is not None:
                held.release()
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, 2 processes on {os.cpu_count()} CPU cores, 1 thread each; "
              f"medians of {rounds} rounds of {calls} calls")
        print("| call | us per call |")
        print("|---|---|")
        for name, samples in times.items():
            print(f"| {name} | {statistics.median(samples):.1f} |")
    dist.destroy_process_group()


def _one_process(calls, rounds):
    """dist.all_reduce in a group of this process alone, with and without the write kernel."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    flags = torch.zeros(2, dtype=torch.int32)
    times = {"bare dist.all_reduce (2 int32)": [], WRITES_SEEN: []}
    for _ in range(20):
        dist.all_reduce(flags)
    for _ in range(rounds):
        for name, samples in times.items():
            held = distributed.seen_as_writes() if name == WRITES_SEEN else None
            start = time.perf_counter()
            for _ in range(calls * 10):
                dist.all_reduce(flags)
            samples.append((time.perf_counter() - start) / (calls * 10) * 1e6)
            if held is not None:
                held.release()
    dist.destroy_process_group()
    print(f"torch {torch.__version__}, gloo, one process (a group of one rank); medians of {rounds} rounds of "
          f"{calls * 10} calls")
    print("| call | us per call |")
    print("|---|---|")
    for name, samples in times.items():
        print(f"| {name} | {statistics.median(samples):.1f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _one_process(args.calls, args.rounds)
    mp.start_processes(_worker, args=(_free_port(), args.calls, args.rounds), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
