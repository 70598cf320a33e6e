"""What the benchmark scripts share: the small GPT-2 they build and the loop that times variants.

``gpt2(...)`` is transformers' GPT2LMHeadModel from a config, random weights (nothing downloaded),
seeded so that every variant of a script starts from the same weights.

``round_robin(steps, repeats)`` times callables against each other on a shared, noisy machine:
the variants take turns within each round (the order reversed every other round, so none always
runs after the same neighbour), the first rounds only warm up (allocator, lazy init), and each
variant's median is returned. Only figures from the same call compare.
"""

import statistics
import time

import torch


def gpt2(layers, width, heads, vocab, positions, seed=0, **config):
    """A GPT2LMHeadModel of ``layers`` blocks of ``width``, random weights from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions, **config))


def round_robin(steps, repeats, warm_up=2, synchronize=None):
    """Median seconds per call of each of ``steps`` (name -> callable taking the round's index),
    over ``repeats`` rounds after ``warm_up`` untimed ones. ``synchronize``: called around each
    timed call (a device's queue drained, so the time is the step's)."""
    names = list(steps)
    times = {name: [] for name in names}
    for index in range(warm_up + repeats):
        for name in (names if index % 2 == 0 else names[::-1]):
            if synchronize is not None:
                synchronize()
            start = time.perf_counter()
            steps[name](index)
            if synchronize is not None:
                synchronize()
            if index >= warm_up:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
