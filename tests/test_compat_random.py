"""Random scenarios against the reference: module trees with shared and re-entered modules,
nested tuple outputs, None and non-tensor values, trace batches, abort, small rings and nan/inf
injected at random places, in both check modes and with a tiny check="batch" buffer."""

import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from compat import ReferenceDetector, run
from overflow_fast import DebugUnderflowOverflow

INF, NAN = float("inf"), float("nan")


class Poison(nn.Module):
    """Passes its input through, turning one element into nan/inf on the batches it is told."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule  # {call index: value}
        self.calls = 0

    def forward(self, x):
        value = self.schedule.get(self.calls)
        self.calls += 1
        if value is None:
            return x
        x = x.clone()
        x.view(-1)[0] = value
        return x


class Pair(nn.Module):
    """Returns nested tuples with None and a non-tensor, as some transformers layers do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, extra=None):
        y = self.lin(x)
        return y, (y * 2, None, 3), None


class Tree(nn.Module):
    def __init__(self, plan, schedule):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.poison = Poison(schedule)
        self.blocks = nn.ModuleList()
        for kind in plan:
            if kind == "linear":
                self.blocks.append(nn.Linear(4, 4))
            elif kind == "pair":
                self.blocks.append(Pair())
            elif kind == "seq":
                self.blocks.append(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Identity()))
            else:  # "shared": the first Linear again, under a second name
                self.blocks.append(self.first)
        self.plan = plan

    def forward(self, x):
        x = self.first(x)
        x = self.poison(x)
        for kind, block in zip(self.plan, self.blocks):
            if kind == "pair":
                x = block(x, None)[1][0]
            else:
                x = block(x)
        return x


scenarios = st.fixed_dictionaries({
    "plan": st.lists(st.sampled_from(["linear", "pair", "seq", "shared"]), min_size=1, max_size=4),
    "schedule": st.dictionaries(st.integers(0, 4), st.sampled_from([NAN, INF, -INF]), max_size=2),
    "batches": st.integers(1, 5),
    "max_frames": st.integers(0, 6),
    "trace": st.lists(st.integers(0, 4), max_size=3),
    "abort": st.one_of(st.none(), st.integers(0, 4)),
    "steps": st.sampled_from(["forward", "backward"]),
    "dtype": st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    "buffer_rows": st.sampled_from([4, 64, 1 << 16]),
})


def _script(kind):
    def forward(model, x):
        if kind == "forward":
            with torch.no_grad():
                model(x)
        else:
            model(x).float().sum().backward()

    return forward


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_random_scenarios_print_what_the_reference_prints(s):
    generator = torch.Generator().manual_seed(len(s["plan"]) + s["batches"])
    data = [torch.randn(2, 4, generator=generator).to(s["dtype"]) for _ in range(s["batches"])]
    kwargs = {"max_frames_to_save": s["max_frames"], "trace_batch_nums": s["trace"],
              "abort_after_batch_num": s["abort"]}

    def build():
        torch.manual_seed(0)
        return Tree(s["plan"], s["schedule"]).to(s["dtype"])

    want_out, want_outcomes, _ = run(ReferenceDetector, build(), data, _script(s["steps"]), **kwargs)
    for check, extra in (("module", {}), ("batch", {"buffer_rows": s["buffer_rows"]})):
        got_out, got_outcomes, _ = run(DebugUnderflowOverflow, build(), data, _script(s["steps"]), check=check,
                                       **extra, **kwargs)
        if "Last" in want_out and s["trace"] or s["max_frames"] == 0:
            # after a traced batch or a dump the reference's ring is an unbounded list (README):
            # compare everything but the frames of the dumps
            want_out, got_out = _without_dumped_frames(want_out), _without_dumped_frames(got_out)
        assert got_outcomes == want_outcomes, check
        assert got_out == want_out, check


_DUMP = re.compile(r"Last \d+ forward frames:\nabs min  abs max  metadata\n(.*?)\n\n\n\n", re.DOTALL)


def _without_dumped_frames(text):
    # a dump ends with four newlines; frames never hold more than three in a row
    return _DUMP.sub("Last N forward frames: ...\n\n\n\n", text)
