"""An interrupted pass ends. torch runs ``always_call`` forward hooks only for an ``Exception``, and
autograd runs the callbacks queued for a backward's end only when the backward succeeds: a
KeyboardInterrupt (Ctrl-C in a notebook), SystemExit or any BaseException raised inside a forward or
a backward, from the model or from another library's hook, leaves the detector as it was: the next
forward detects, its report is the reference's, and nothing of the interrupted pass is kept."""

import math
import weakref

import pytest
import torch
from torch import nn

from compat import ReferenceDetector, capture, run
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch


class Stop(BaseException):
    """A BaseException of someone else's (neither Exception, nor KeyboardInterrupt, nor SystemExit)."""


INTERRUPTS = [KeyboardInterrupt, SystemExit, Stop]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.interrupt = None

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.interrupt is not None:
            raise self.interrupt()
        return h


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Block(), Block(), nn.Linear(4, 2))


def batch(seed, nan=False):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    if nan:
        x[1, 2] = math.nan
    return x


ATTACH = {
    "watch": lambda m: watch(m),
    "batch": lambda m: DebugUnderflowOverflow(m, check="batch"),
    "batch-find_op": lambda m: DebugUnderflowOverflow(m, check="batch", find_op=True),
    "module-find_op": lambda m: DebugUnderflowOverflow(m, find_op=True),
}


def interrupted(fn, interrupt):
    try:
        fn()
    except interrupt:
        return True
    return False


@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("attach", sorted(ATTACH))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_after_an_interrupted_forward_the_next_forward_detects_and_keeps_nothing(interrupt, attach, grad):
    net = model()
    ATTACH[attach](net)
    net[2].interrupt = interrupt
    with torch.set_grad_enabled(grad):
        assert interrupted(lambda: net(batch(0)), interrupt)
    net[2].interrupt = None
    # the next forwards keep none of their inputs once they returned
    alive = []
    for seed in range(1, 6):
        x = batch(seed)
        alive.append(weakref.ref(x))
        with torch.set_grad_enabled(grad):
            net(x)
        del x
    # (find_op keeps a forward with autograd on until the backward that follows it)
    assert not [ref for ref in (alive[:-1] if grad else alive) if ref() is not None]
    out, error = capture(lambda: net(batch(9, nan=True)))
    assert isinstance(error, OverflowDetected) and error.batch_number == 5, out
    assert "Detected inf/nan during batch_number=5" in out


@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("check", ["module", "batch"])
def test_the_reports_after_an_interrupt_are_the_references(interrupt, check):
    def steps(net, x):
        net[1].interrupt = interrupt if x is batches[1] else None
        try:
            net(x)
        except interrupt:
            pass

    batches = [batch(0), batch(1), batch(2), batch(3, nan=True)]
    reference = run(ReferenceDetector, model(), batches, steps)
    ours = run(DebugUnderflowOverflow, model(), batches, steps, check=check)
    assert ours[:2] == reference[:2]
    assert reference[1][-1] is not None and "Detected inf/nan" in reference[0]


@pytest.mark.parametrize("where", ["pre hook", "hook"])
def test_an_interrupt_from_another_librarys_forward_hook(where):
    net = model()
    watch(net)
    raise_it = lambda *args: (_ for _ in ()).throw(KeyboardInterrupt())  # noqa: E731
    handle = (net[1].register_forward_pre_hook(raise_it) if where == "pre hook"
              else net[1].fc.register_forward_hook(raise_it))
    with torch.no_grad():
        assert interrupted(lambda: net(batch(0)), KeyboardInterrupt)
    handle.remove()
    with torch.no_grad():
        net(batch(1))
    out, error = capture(lambda: net(batch(2, nan=True)))
    assert isinstance(error, OverflowDetected) and error.batch_number == 1 and error.phase == "forward", out


def test_a_nan_seen_before_an_interrupt_is_reported_once_and_not_held_against_the_next_forward():
    net = model()
    watch(net)
    net[2].interrupt = KeyboardInterrupt

    def forward():
        with torch.no_grad():
            net(batch(0, nan=True))

    out, _ = capture(lambda: interrupted(forward, KeyboardInterrupt))
    assert "Detected inf/nan" not in out  # with check="batch" the pass had not ended yet
    net[2].interrupt = None
    out, error = capture(lambda: net(batch(1)))
    # the interrupted pass ends at the next forward's first hook: its report, then a clean forward
    assert error is None and out.count("Detected inf/nan during batch_number=0") == 1
    assert "that report is of a pass that an exception interrupted before its end" in out
    out, error = capture(lambda: net(batch(2)))
    assert error is None and out == ""


class _InterruptAt:
    """Another library's gradient hook that raises a KeyboardInterrupt while it is armed."""

    def __init__(self):
        self.armed = False

    def __call__(self, grad):
        if self.armed:
            raise KeyboardInterrupt


@pytest.mark.parametrize("attach", ["watch", "batch-backward", "module-backward-find_op"])
def test_after_an_interrupted_backward_the_next_step_is_decided_alone(attach):
    net = model()
    {"watch": lambda: watch(net), "batch-backward": lambda: DebugUnderflowOverflow(net, check="batch", backward=True),
     "module-backward-find_op": lambda: DebugUnderflowOverflow(net, backward=True, find_op=True)}[attach]()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    stop = _InterruptAt()
    net[0].weight.register_hook(stop)  # runs late in the backward, after net[3]'s gradients
    # (check="module" would decide an inf gradient at once, before the interrupt)
    poison = net[3].weight.register_hook(lambda grad: grad * (1 if attach.startswith("module") else math.inf))

    def step(seed):
        optimizer.zero_grad()
        net(batch(seed)).square().mean().backward()

    # an inf gradient, then the interrupt before the backward ends: nothing was decided yet
    stop.armed = True
    out, error = capture(lambda: interrupted(lambda: step(0), KeyboardInterrupt))
    stop.armed = False
    poison.remove()
    # the next step is clean and decided alone (the interrupted backward never reaches its decision)
    out, error = capture(lambda: step(1))
    assert error is None and "backward of batch_number=1" not in out
    # and the one after detects its own inf gradient
    poison = net[3].weight.register_hook(lambda grad: grad * math.inf)
    out, error = capture(lambda: step(2))
    assert isinstance(error, OverflowDetected) and error.phase == "backward" and error.batch_number == 2, out


def test_a_model_that_calls_itself_is_not_an_abandoned_pass():
    class Tree(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaf = nn.Linear(4, 4)

        def forward(self, x, depth=3):
            return self.leaf(x) if depth == 0 else self(self.leaf(x), depth - 1)

    tree = Tree()
    detector = DebugUnderflowOverflow(tree, check="batch")
    out, error = capture(lambda: tree(batch(0)))
    assert error is None and detector.total_calls == 8
    x = batch(1)
    x[0, 0] = math.nan
    out, error = capture(lambda: tree(x))
    # one pass: its calls are decided together when the outermost returns
    assert isinstance(error, OverflowDetected) and error.batch_number == 4, out
