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
