"""torch.compile with the detector attached: graph breaks and compile time.

For each variant (no detector, check="batch", check="module", ``watch()``) on a model built fresh
from the same seed: ``torch._dynamo.explain`` (graphs, graph breaks, their reasons), then the time
of the first call of ``torch.compile(model)`` (``--backend``, inductor by default: tracing plus code
generation, with a cold dynamo cache and inductor's caches off, so no variant reuses another's
kernels), the median time of the following calls, and
whether later batches recompiled. Forward only, under no_grad.

Models: ``mlp`` (the 9-module MLP of RESULTS.md: Linear, GELU, Linear, LayerNorm, ReLU, Linear,
Tanh, Linear, Softmax; input 4x16) and ``gpt2`` (transformers GPT2LMHeadModel, 2 layers, n_embd 64,
vocab 1000, random weights, input 2x32 tokens).

    .venv/bin/python benchmarks/bench_compile.py [--models mlp,gpt2] [--backend inductor] [--calls 5]
        [--csv PATH]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

import overflow_fast  # noqa: E402
from overflow_fast import DebugUnderflowOverflow  # noqa: E402

VARIANTS = ("none", "batch", "module", "watch")


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8), nn.Softmax(-1))
    return model, (torch.randn(4, 16),)


def gpt2():
    return _shared.gpt2(2, 64, 4, 1000, 64).eval(), (torch.randint(0, 1000, (2, 32)),)


MODELS = {"mlp": mlp, "gpt2": gpt2}


def attach(model, variant):
    if variant == "none":
        return None
    if variant == "watch":
        return overflow_fast.watch(model)
    return DebugUnderflowOverflow(model, check=variant)


def _reason(record):
    """A graph break's reason in one short line, with where it happened."""
    text = " ".join(str(record.reason).split())[:80]
    where = record.user_stack[-1] if record.user_stack else None
    return f"{text} ({os.path.basename(where.filename)}:{where.lineno})" if where else text


def measure(build, variant, backend, calls):
    model, args = build()
    attach(model, variant)
    dynamo.reset()
    explained = dynamo.explain(model)(*args)
    reasons = sorted({_reason(r) for r in explained.break_reasons})
    if explained.graph_break_count and not reasons:
        # dynamo records no reason for a call to a torch.compiler.disable'd function
        reasons = ["a torch.compiler.disable'd call (the detector's end-of-forward read)"]
    model, args = build()
    attach(model, variant)
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(*args)
        first = time.perf_counter() - start
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            compiled(*args)
            times.append(time.perf_counter() - start)
    return dict(graphs=explained.graph_count, breaks=explained.graph_break_count, reasons=reasons,
                first_s=first, call_ms=statistics.median(times) * 1e3,
                unique_graphs=counters["stats"]["unique_graphs"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt2")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--calls", type=int, default=5, help="calls timed after the first")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    print(_results.machine_line(), flush=True)
    rows = []
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True  # no variant reuses another's generated code
    if True:
        print(f"backend={args.backend}; first call = dynamo tracing + {args.backend} compile; "
              f"graphs after {args.calls + 1} calls = unique graphs compiled (more than 'graphs' means recompiles)")
        # one-time costs (inductor's imports, its worker pool) go to a throwaway compile first
        warm = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2, backend=args.backend)
        with torch.no_grad():
            warm(torch.randn(4))
        print()
        print("| model | variant | graphs | graph breaks | first call (s) | later calls (ms, median) "
              "| graphs after all calls | break reasons |")
        print("|---|---|---|---|---|---|---|---|")
        for name in [m for m in args.models.split(",") if m]:
            for variant in VARIANTS:
                r = measure(MODELS[name], variant, args.backend, args.calls)
                print(f"| {name} | {variant} | {r['graphs']} | {r['breaks']} | {r['first_s']:.2f} | "
                      f"{r['call_ms']:.2f} | {r['unique_graphs']} | {'; '.join(r['reasons'])} |", flush=True)
                rows.append((f"{name} {variant}: graph breaks", r["breaks"], "per forward"))
                rows.append((f"{name} {variant}: first compiled call", r["first_s"], "s"))
                rows.append((f"{name} {variant}: compiled call", r["call_ms"], "ms"))
                rows.append((f"{name} {variant}: graphs compiled", r["unique_graphs"], f"after {args.calls + 1} calls"))
    _results.write_rows(args.csv, "compile", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
