"""The Python HookCore (overflow_fast/hooks/hook_core.py) and the C++ one (csrc/hooks.cpp) are one
specification: on the same random sequences of calls (tensors reused, changed in place, swapped
through ``.data``, freed, dropped; views, inference, sparse, subclass and meta tensors; several
devices; a full buffer, a small deferral budget, a small reuse table) they give the same answers.
The detector's behaviour on the Python one is tested by the compatibility, detector and reads tests
under OVERFLOW_FAST_WITHOUT_EXTENSION=1 (`make test` runs them so)."""

import gc
import random
import weakref

import pytest
import torch

from overflow_fast.hooks import hook_core
from overflow_fast.stats import cpu_backend

C = hook_core.native()  # the hook layer's C++ module (the extension's submodule ``hooks``)
needs_extension = pytest.mark.skipif(C is None, reason=f"the C++ extension is unavailable "
                                                        f"({cpu_backend.unavailable_reason()})")


class Sub(torch.Tensor):
    """A subclass with ``__torch_function__`` (not a wrapper): the twin reads it with that off."""


def make(rng):
    """A new tensor of a random kind and device, and how it may be changed."""
    kind = rng.choice(["plain", "plain", "plain", "grad", "parameter", "meta", "inference", "sparse", "sub",
                       "empty", "half"])
    if kind == "meta":
        return torch.ones(rng.randint(1, 6), device="meta"), kind
    if kind == "inference":
        with torch.inference_mode():
            return torch.ones(rng.randint(1, 6)), kind
    if kind == "sparse":
        return torch.ones(rng.randint(1, 6)).to_sparse(), kind
    if kind == "grad":
        return torch.ones(rng.randint(1, 6), requires_grad=True), kind
    if kind == "parameter":
        return torch.nn.Parameter(torch.ones(rng.randint(1, 6))), kind
    if kind == "sub":
        return torch.ones(rng.randint(1, 6)).as_subclass(Sub), kind
    if kind == "empty":
        return torch.ones(0), kind
    if kind == "half":
        return torch.ones(rng.randint(1, 6), dtype=torch.float16), kind
    return torch.ones(rng.randint(1, 6)), kind


def freed(tensor):
    """Whether a tensor's memory was freed (``resize_(0)`` of its storage)."""
    return tensor.layout == torch.strided and tensor.untyped_storage().nbytes() < \
        (tensor.storage_offset() + tensor.numel()) * tensor.element_size()


def change(tensor, how):
    """Change a tensor the way a model might between hooks (the same object for both cores)."""
    if freed(tensor):
        return  # touching it would crash
    try:
        with torch.no_grad(), torch.inference_mode(tensor.is_inference()):
            if how == "in place":
                tensor.add_(1)
            elif how == "data":
                tensor.data = tensor.data.clone()
            elif how == "free":
                tensor.untyped_storage().resize_(0)
    except (RuntimeError, NotImplementedError):
        pass  # not every kind can be changed every way: a no-op for both


class Labels:
    """Tensors by the label of their creation, to compare answers that hold tensors."""

    def __init__(self):
        self.of = {}

    def name(self, tensor, label):
        self.of[id(tensor)] = (weakref.ref(tensor), label)  # a dropped tensor may die

    def __call__(self, tensor):
        known = self.of.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return known[1]
        # a stand-in for a deferred tensor changed since its hook
        return ("stand-in", tuple(tensor.shape), tensor.dtype, tensor.device.type)


def normal(answer, label):
    """An answer with its tensors replaced by labels, types kept."""
    if isinstance(answer, list):  # pending()
        return ("pending", [(key, first, [label(t) for t in to_read], list(changed), read)
                            for key, first, to_read, changed, read in answer])
    key, rows, first, to_read, changed, read = answer
    if key < 0:  # not added: the reason alone
        assert (rows, first, to_read, changed, read) == (None, None, None, None, None), answer
        return (key, None, None, None, None, None)
    assert type(rows) is tuple and type(to_read) is list and type(changed) is list, answer
    assert read == hook_core.READ_BY_CALLER or not to_read, answer  # (no launcher bound here)
    return (key, rows, first, [label(t) for t in to_read], changed, read)


def both(capacity, stage_bytes, max_remembered):
    return C.HookCore(capacity, stage_bytes, max_remembered), hook_core.HookCore(capacity, stage_bytes, max_remembered)


def run_sequence(seed, steps=40):
    rng = random.Random(seed)
    capacity = rng.choice([3, 6, 16, 64])
    stage_bytes = rng.choice([0, 16, 64, 1 << 20])
    max_remembered = rng.choice([0, 2, 5, 1 << 16])
    cores = both(capacity, stage_bytes, max_remembered)
    labels = Labels()
    pool = []  # (tensor, kind)
    count = 0
    sites = [-1, 0, 1, 2, id(pool)]
    log = []
    for _ in range(steps):
        op = rng.choices(["add", "new", "view", "change", "drop", "pending", "reset", "unchanged"],
                         [8, 3, 1, 3, 1, 1, 1, 2])[0]
        if op == "new" or not pool:
            tensor, kind = make(rng)
            labels.name(tensor, count)
            pool.append((tensor, kind))
            count += 1
        elif op == "view":
            base, kind = rng.choice(pool)
            if kind in ("plain", "grad", "meta", "half") and base.numel() > 1 and not freed(base):
                view = base[1:]
                labels.name(view, count)
                pool.append((view, kind))
                count += 1
        elif op == "change":
            tensor, _ = rng.choice(pool)
            change(tensor, rng.choice(["in place", "in place", "data", "free"]))
        elif op == "drop":
            pool.pop(rng.randrange(len(pool)))  # dies unless a core holds it: its address may be reused
        elif op == "pending":
            answers = [normal(core.pending(), labels) for core in cores]
            assert answers[0] == answers[1], (seed, log, answers)
            log.append(("pending", answers[0]))
        elif op == "reset":
            for core in cores:
                core.reset()
            log.append("reset")
        elif op == "unchanged":  # whether a tensor is unchanged since its read into a row
            tensor, _ = rng.choice(pool)
            key, row = rng.randrange(2), rng.randrange(capacity)
            answers = [core.unchanged(tensor, key, row) for core in cores]
            assert answers[0] == answers[1], (seed, log, labels(tensor), key, row, answers)
            log.append(("unchanged", labels(tensor), key, row, answers[0]))
        if op == "add":
            tensors = [rng.choice(pool)[0] for _ in range(rng.randint(1, 4))]
            site = rng.choice(sites)
            defer = rng.random() < 0.7
            answers = [normal(core.add(tensors, site, defer), labels) for core in cores]
            assert answers[0] == answers[1], (seed, log, [labels(t) for t in tensors], site, defer, answers)
            log.append(("add", [labels(t) for t in tensors], site, defer, answers[0]))
            if answers[0][0] == hook_core.HOOK_FULL:  # as the detector does: read what waits, start over
                assert normal(cores[0].pending(), labels) == normal(cores[1].pending(), labels)
                for core in cores:
                    core.reset()
                log.append("full: reset")
            elif answers[0][0] >= 0:
                key = answers[0][0]
                assert cores[0].used(key) == cores[1].used(key)
                assert cores[0].device(key) == cores[1].device(key)
    final = [normal(core.pending(), labels) for core in cores]
    assert final[0] == final[1], (seed, log, final)
    return log


@needs_extension
@pytest.mark.parametrize("block", range(8))
def test_random_sequences_give_the_same_answers(block):
    for seed in range(block * 40, (block + 1) * 40):
        run_sequence(seed)


@needs_extension
def test_the_sequences_reach_every_answer():
    # the random sequences are worth something only if they reach each kind of answer
    seen = set()
    for seed in range(120):
        for entry in run_sequence(seed):
            if entry == "full: reset":
                seen.add("full")
            elif entry[0] == "add":
                answer = entry[-1]
                if answer[0] == hook_core.HOOK_MIXED_DEVICES:
                    seen.add("mixed")
                elif answer[0] >= 0:
                    key, rows, first, to_read, changed, _ = answer
                    seen.add("read now" if to_read else "waits")
                    if len(set(rows)) < len(rows) or (to_read and len(rows) > len(to_read)):
                        seen.add("reused")
                    if changed:
                        seen.add("changed")
                    if key > 0:
                        seen.add("second device")
            elif entry[0] == "pending" and entry[1][1]:
                seen.add("pending")
            elif entry[0] == "unchanged":
                seen.add(f"unchanged {entry[-1]}")
    assert seen >= {"full", "mixed", "read now", "waits", "reused", "changed", "second device", "pending",
                    "unchanged 1", "unchanged 0", "unchanged -1"}, seen


@pytest.mark.parametrize("core_class", [pytest.param(hook_core.HookCore, id="twin"),
                                        pytest.param(getattr(C, "HookCore", None), id="c++", marks=needs_extension)])
def test_a_core_tells_whether_a_tensor_is_unchanged_since_its_read(core_class):
    """1: read into that row and unchanged since; 0: changed since (in place, or read again into
    another row because it had changed); -1: not known (never read, reuse off, forgotten)."""
    core = core_class(8, 0, 4)
    x, y = torch.ones(3), torch.ones(3)
    key, (row,), *_ = core.add([x], -1, False)
    assert core.unchanged(x, key, row) == 1 and core.unchanged(y, key, row) == -1
    assert core.unchanged(x, key, row + 1) == 0  # not the row it was read into: not what that row read
    x.mul_(2)
    assert core.unchanged(x, key, row) == 0
    _, (again,), *_ = core.add([x], -1, False)  # changed: read again, into a new row
    assert again != row and core.unchanged(x, key, row) == 0 and core.unchanged(x, key, again) == 1
    core.add([torch.ones(1) for _ in range(4)], -1, False)  # past max_remembered: the reads are forgotten
    assert core.unchanged(x, key, again) == -1
    core.reset()
    assert core.unchanged(x, key, again) == -1
    without_reuse = core_class(8, 0, 0)
    _, (row,), *_ = without_reuse.add([y], -1, False)
    assert without_reuse.unchanged(y, key, row) == -1
    with pytest.raises(TypeError):
        core.unchanged(3, key, row)


@needs_extension
def test_a_pass_of_a_model_s_shape():
    # the detector's pattern: each call's output is the next one's input; first pass read in the
    # hooks, from the second on every site waits and the pass is one read
    for core in both(64, 1 << 20, 1 << 16):
        torch.manual_seed(0)
        weights = [torch.randn(4, 4, requires_grad=True) for _ in range(3)]
        answers = []
        for step in range(3):
            x = torch.randn(2, 4)
            per_pass = []
            for site, w in enumerate(weights):
                y = (x @ w).detach()
                key, rows, first, to_read, changed, _ = core.add([w, x, y], site, True)
                per_pass.append((rows, first, len(to_read), changed))
                x = y
            per_pass.append([(key, first, len(to_read), changed) for key, first, to_read, changed, _ in core.pending()])
            core.reset()
            answers.append(per_pass)
        if core.__class__.__module__ == hook_core.__name__:
            assert answers == expected
        expected = answers
    # rows: x of one call is y of the one before; 3 + 2 + 2 rows; waits from the second pass on
    assert expected[0][:3] == [((0, 1, 2), 0, 3, []), ((3, 2, 4), 3, 2, []), ((5, 4, 6), 5, 2, [])]
    assert expected[1][:3] == [((0, 1, 2), 0, 0, []), ((3, 2, 4), 0, 0, []), ((5, 4, 6), 0, 0, [])]
    assert expected[1][3] == [(0, 0, 7, [])]


def test_bad_arguments_raise_as_the_extension_does():
    cores = [hook_core.HookCore] + ([C.HookCore] if C is not None else [])
    for HookCore in cores:
        with pytest.raises(RuntimeError, match="capacity must be positive"):
            HookCore(0, 0, 0)
        with pytest.raises(RuntimeError, match="stage_bytes must be >= 0"):
            HookCore(1, -1, 0)
        with pytest.raises(RuntimeError, match="no tensors"):
            HookCore(1, 0, 0).add([], -1, False)
        with pytest.raises(TypeError):
            HookCore(1, 0, 0).add([torch.ones(1), 3], -1, False)
    if C is not None:
        assert (C.HOOK_FULL, C.HOOK_MIXED_DEVICES) == (hook_core.HOOK_FULL, hook_core.HOOK_MIXED_DEVICES)


def test_binding_a_launcher_to_the_python_core_changes_nothing():
    # there is no launcher without the extension: the twin hands every tensor back, bound or not
    core = hook_core.HookCore(4, 0, 16)
    x = torch.ones(2)
    key = core.add([x], -1, False)[0]
    core.bind(key, object(), torch.empty(4, 8, dtype=torch.int64))
    y = torch.ones(3)
    assert core.add([y], -1, False)[3] == [y]
    with pytest.raises(IndexError):
        core.bind(5, None, None)
    if C is not None:
        with pytest.raises(IndexError):
            C.HookCore(4, 0, 16).bind(5, None, torch.empty(0))


def test_the_python_core_works_without_the_extension():
    # the parts that need no C++ core to compare with: reuse, full, several devices, deferral
    core = hook_core.HookCore(4, 1 << 20, 1 << 16)
    x, y = torch.ones(2), torch.ones(3)
    assert core.add([x, y], -1, False) == (0, (0, 1), 0, [x, y], [], hook_core.READ_BY_CALLER)
    key, rows, first, to_read, changed, _ = core.add([y, x], -1, False)
    assert (rows, to_read) == ((1, 0), [])
    x.add_(1)
    assert core.add([x], -1, False)[1:4] == ((2,), 2, [x])
    assert core.add([torch.ones(1), torch.ones(1)], -1, False) == (hook_core.HOOK_FULL,) + (None,) * 5
    assert core.add([x, torch.ones(1, device="meta")], -1, False) == (hook_core.HOOK_MIXED_DEVICES,) + (None,) * 5
    assert core.add([torch.ones(1, device="meta")], -1, False)[0] == 1
    assert (core.used(0), core.device(1)) == (3, torch.device("meta"))
    core.reset()
    assert core.used(0) == 0


@pytest.mark.parametrize("defer", [False, True])
def test_without_the_extension_an_accelerator_s_pass_is_one_host_read(monkeypatch, defer):
    # Reads on the Python core: the rows stay on the device until the pass ends (no read per hook),
    # and unchanged tensors keep their rows (a Linear's output is the next module's input)
    import overflow_fast.hooks.reads as reads_module
    from overflow_fast.stats import kinds
    from torch import nn
    from overflow_fast import DebugUnderflowOverflow

    monkeypatch.setattr(cpu_backend, "extension", lambda: None)  # the hook layer takes the Python core
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)
    calls, reads = [], []
    real_stats, real_cpu = reads_module.tensor_stats, torch.Tensor.cpu

    def stats(tensors, backend=None, *, out=None):
        calls.append(len(tensors))
        return real_stats(tensors, backend, out=out)

    def cpu(self, *args, **kwargs):
        reads.append(self.shape)
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(reads_module, "tensor_stats", stats)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch", defer=defer)
    per_forward = []
    for _ in range(3):
        calls.clear()
        reads.clear()
        with torch.no_grad():
            model(torch.randn(2, 4))
        per_forward.append((list(calls), len(reads)))
    later = [([8], 1)] * 2 if defer else [([4, 1, 3], 1)] * 2
    assert per_forward == [([4, 1, 3], 1)] + later


# -- output-gradient hooks: csrc/hooks.cpp's OutputGradients and its twin ----------------------------

OUTPUT_GRADIENTS = [pytest.param(hook_core.OutputGradients, id="twin"),
                    pytest.param(getattr(C, "OutputGradients", None), id="c++", marks=needs_extension)]


def _entries(items):
    from overflow_fast.hooks.frames import entries_of

    entries, tensors, _ = entries_of(items)
    return entries, tensors


def _tensor_hooks_reference(forward):
    """What plain tensor hooks see: (ctx, gradient) in the order they fire."""
    seen = []

    def register(module, items):
        for tensor, ctx in items:
            if ctx.startswith("output") and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, ctx=ctx: seen.append((f"{ctx}.grad", grad.clone())))

    forward(register).backward()
    return seen


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_output_gradients_are_seen_as_tensor_hooks_see_them_and_change_nothing(make):
    weight = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    inner, outer, consumer = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()

    def forward(register):
        hidden = x @ weight
        split = torch.nn.functional.relu(hidden).split(2)  # outputs of one node
        shifted = hidden - 0.5
        register(inner, [(weight, "weight"), (x, "input[0]"), (hidden, "output[0]"), (split, "output[1]"),
                         (split[0], "output[1][0]"), (split[1], "output[1][1]"), (shifted, "output[2]"), (3, "output[3]")])
        register(consumer, [(shifted, "input[0]"), (split[0], "input[1]")])
        shifted.relu_()  # in place after the hook: the hook sees the gradient before it
        return (split[0] * 2).sum() + (split[1] ** 2).sum() + (shifted ** 3).sum()

    forward(lambda module, items: None).backward()
    plain = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    expected = _tensor_hooks_reference(forward)
    expected_grads = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    seen, apart = [], []
    outputs = make(lambda owner, grad: seen.append((list(owner), grad.clone())), lambda *a: apart.append(a))
    outputs.new_forward()
    forward(lambda module, items: outputs.watch(module, *_entries(items))).backward()
    assert [owner[1] for owner, _ in seen] == [ctx for ctx, _ in expected]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(seen, expected))
    assert all(owner[0]() is inner for owner, _ in seen) and not apart  # modules held weakly
    consumers = {owner[1]: [module() for module in owner[2]] for owner, _ in seen}
    assert consumers == {"output[0].grad": [], "output[1][0].grad": [consumer], "output[1][1].grad": [],
                         "output[2].grad": [consumer]}
    assert torch.equal(weight.grad, plain[0]) and torch.equal(x.grad, plain[1])
    assert torch.equal(expected_grads[0], plain[0])
    assert outputs.incoming_read(inner) and not outputs.incoming_read(consumer)
    outputs.new_forward()
    assert not outputs.incoming_read(inner)


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_an_output_several_modules_return_is_hooked_once_under_the_outermost(make):
    x = torch.randn(3, requires_grad=True)
    seen, apart = [], []

    def hook_apart(tensor, hook):  # a subclass's own register_hook
        apart.append(tensor)
        tensor.register_hook(hook)

    outputs = make(lambda owner, grad: seen.append(list(owner)), hook_apart)
    inner, outer = torch.nn.Identity(), torch.nn.Identity()
    y = x * 2
    sub = (x * 3).as_subclass(Sub)
    outputs.watch(inner, *_entries([(y, "output"), (sub, "output[1]")]))
    outputs.watch(outer, *_entries([(y, "output[0]"), (sub, "output[1]")]))
    with torch.no_grad():
        outputs.watch(inner, *_entries([(x * 4, "output")]))  # no gradient: nothing hooked
    assert apart == [sub]
    y.sum().backward()
    assert [(owner[0](), owner[1], owner[3]) for owner in seen] == [(outer, "output[0].grad", id(y))]
    sub.sum().backward()
    assert [(owner[0](), owner[1], owner[3]) for owner in seen[1:]] == [(outer, "output[1].grad", id(sub))]


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_an_output_gradient_callback_that_raises_raises_from_backward(make):
    x = torch.randn(3, requires_grad=True)
    y = x * 2

    def fails(owner, grad):
        raise ValueError(f"bad {owner[1]}")

    outputs = make(fails, None)  # (its hooks call back while it lives)
    outputs.watch(torch.nn.Identity(), *_entries([(y, "output")]))
    with pytest.raises(ValueError, match="bad output.grad"):
        y.sum().backward()


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_output_gradient_hooks_hold_their_modules_weakly(make):
    module, consumer = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    alive = weakref.ref(module), weakref.ref(consumer)
    seen = []
    outputs = make(lambda owner, grad: seen.append(owner[1]), None)
    y = torch.ones(2, requires_grad=True) * 3
    outputs.watch(module, *_entries([(y, "output")]))
    outputs.watch(consumer, *_entries([(y, "input[0]")]))
    outputs.new_forward()
    del module, consumer
    assert [ref() for ref in alive] == [None, None]  # the graph holds y's hook, which holds them weakly
    y.sum().backward()
    assert seen == ["output.grad"]


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_cleared_output_gradients_hooks_do_nothing_and_hold_nothing(make):
    class Callback:
        def __init__(self):
            self.seen = []

        def __call__(self, owner, grad):
            self.seen.append(owner[1])

    callback = Callback()
    alive = weakref.ref(callback)
    outputs = make(callback, lambda tensor, hook: tensor.register_hook(hook))
    y = torch.ones(2, requires_grad=True) * 3
    sub = (torch.ones(2, requires_grad=True) * 2).as_subclass(Sub)
    outputs.watch(torch.nn.Identity(), *_entries([(y, "output[0]"), (sub, "output[1]")]))
    outputs.clear()
    outputs.watch(torch.nn.Identity(), *_entries([(y * 2, "output")]))  # cleared: hooks nothing
    del callback
    assert alive() is None  # the hooks on y and sub (alive) hold nothing of it
    (y.sum() + sub.sum()).backward()


@pytest.mark.parametrize("make", OUTPUT_GRADIENTS)
def test_a_reference_cycle_through_output_gradients_is_collected(make):
    """Its callback leads back to it (as the detector's does, through the model): the collector
    sees the references it holds, so the cycle goes once nothing else holds it."""
    class Owner:
        def callback(self, owner, grad):
            pass

    holder = Owner()
    holder.outputs = make(holder.callback, lambda tensor, hook: tensor.register_hook(hook))
    y = torch.ones(2, requires_grad=True) * 3
    holder.outputs.watch(torch.nn.Identity(), *_entries([(y, "output")]))
    assert gc.is_tracked(holder.outputs)
    alive = weakref.ref(holder)
    del holder
    gc.collect()
    assert alive() is None
    y.sum().backward()  # its hook outlived it: a no-op


# -- a hook call's entries: csrc/hooks.cpp's EntriesOf and frames.entries_of -------------------------

def _values(rng):
    """Values a hook call may hand over: tensors of every kind the engine reads or refuses, and not
    tensors."""
    kind = rng.choice(["tensor", "tensor", "parameter", "meta", "inference", "sparse", "sub", "nested", "int8",
                       "complex", "uint32", "bool", "fp8", "none", "int", "str", "list", "view", "empty"])
    if kind == "parameter":
        return torch.nn.Parameter(torch.randn(3))
    if kind == "meta":
        return torch.ones(2, device="meta")
    if kind == "inference":
        with torch.inference_mode():
            return torch.ones(2)
    if kind == "sparse":
        return torch.ones(3).to_sparse()
    if kind == "sub":
        return torch.ones(2).as_subclass(Sub)
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind == "int8":
        return torch.ones(2, dtype=torch.int8)
    if kind == "complex":
        return torch.ones(2, dtype=torch.complex64)
    if kind == "uint32":
        return torch.ones(2, dtype=torch.uint32)
    if kind == "bool":
        return torch.ones(2, dtype=torch.bool)
    if kind == "fp8":
        return torch.ones(2).to(torch.float8_e4m3fn)
    if kind == "none":
        return None
    if kind == "int":
        return 3
    if kind == "str":
        return "text"
    if kind == "list":
        return [torch.ones(1)]
    if kind == "view":
        return torch.ones(4, 4).t()
    if kind == "empty":
        return torch.ones(0)
    return torch.randn(rng.randint(1, 4), dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]))


def _same(got, want):
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) and all(a is b for a, b in zip(got[1], want[1]))
    assert got[2] == want[2]


@needs_extension
@pytest.mark.parametrize("containers", [False, True])
def test_the_cpp_entries_are_frames_entries_item_for_item(containers):
    import dataclasses

    from overflow_fast.hooks.frames import entries_of, forward_items

    @dataclasses.dataclass
    class Out:
        logits: object
        extra: object = None

    class Opaque:
        def __init__(self):
            self.tensor = torch.ones(1)

    cpp, twin = hook_core.entries_reader(containers), hook_core.EntriesOf(containers)
    assert type(cpp) is not type(twin)
    rng = random.Random(5)

    def value():
        shape = rng.random()
        if shape < 0.1:
            return tuple(_values(rng) for _ in range(rng.randint(0, 3)))
        if shape < 0.15:
            return {"a": _values(rng), "b": [_values(rng), 2]}
        if shape < 0.2:
            return Out(_values(rng), (_values(rng),))
        if shape < 0.25:
            # plain values, and values no container walk opens: an object holding a tensor, a
            # dataclass's class (not an instance of it)
            return rng.choice([1.5, True, 7, "s", b"b", object(), Opaque(), Out])
        return _values(rng)

    class Tied(torch.nn.Module):  # one tensor under two names
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Parameter(torch.ones(2))
            self.second = self.first
            self.third = torch.nn.Parameter(torch.ones(1))

    class Renamed(torch.nn.Linear):  # its own named_parameters
        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            return [("only", self.weight)]

    modules = [torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.LayerNorm(2), torch.nn.Embedding(3, 2),
               torch.nn.Linear(2, 2, bias=False), Tied(), Renamed(2, 2)]
    for _ in range(300):
        items = [(_values(rng), f"ctx{i}") for i in range(rng.randint(0, 7))]
        _same(cpp.of(items), entries_of(items))
        module = rng.choice(modules)
        args = tuple(value() for _ in range(rng.randint(0, 3))) if rng.random() < 0.9 else value()
        kwargs = rng.choice([None, {}, {f"k{i}": value() for i in range(rng.randint(1, 4))}])
        count = rng.randint(0, 20) if rng.random() < 0.1 else rng.randint(0, 3)
        output = tuple(value() for _ in range(count)) if rng.random() < 0.6 else value()
        want = entries_of(forward_items(module, args, output, kwargs, containers))
        _same(cpp.forward(module, args, output, kwargs), want)
        _same(twin.forward(module, args, output, kwargs), want)
    with pytest.raises(TypeError, match="tuples"):
        cpp.of([torch.ones(1)])


@needs_extension
def test_the_cpp_versions_are_culprit_versions_of():
    from overflow_fast.replay.culprit import versions_of

    rng = random.Random(7)
    for _ in range(300):
        args = [_values(rng) for _ in range(rng.randint(0, 5))]
        for value in args:
            if type(value) in (torch.Tensor, torch.nn.Parameter) and value.dtype == torch.float32 \
                    and not value.is_inference() and rng.random() < 0.5:
                with torch.no_grad():
                    value.mul_(1)  # a version counter past 0
        kwargs = rng.choice([None, {}, {f"k{i}": _values(rng) for i in range(rng.randint(1, 3))}])
        container = rng.choice([tuple, list])
        assert C.versions_of(container(args), kwargs) == versions_of(container(args), kwargs)


@needs_extension
def test_the_cpp_tuples_of_plain_values_leave_the_collector_nothing_to_traverse():
    import gc

    from overflow_fast.hooks.frames import container_leaves, opens_nothing, own_parameters, parameters_listed_as_torch
    from overflow_fast.stats import unreadable_reason
    from overflow_fast.stats.kinds import SUPPORTED_DTYPES

    # what a hook hands over lives until its pass is decided: tuples of ints, strs and None are
    # untracked at once (as the collector would untrack them), and one holding anything else is not
    x = torch.ones(2, requires_grad=True)
    versions = C.versions_of((x, x * 2), {"k": x})
    assert versions == (0, 0, 0) and not gc.is_tracked(versions)
    module = torch.nn.Linear(2, 2)
    entries, _, dtypes = hook_core.entries_reader(False).forward(module, (x, None, 3), torch.ones(2, device="meta"),
                                                                 None)
    assert [kind for kind, _, _ in entries] == [0, 0, 0, 1, 2, 3]
    assert not any(gc.is_tracked(entry) for entry in entries)
    assert type(entries) is tuple and type(dtypes) is tuple and not gc.is_tracked(entries) and not gc.is_tracked(dtypes)

    def reason_as_a_list(tensor):
        reason = unreadable_reason(tensor)
        return None if reason is None else [reason]

    reader = C.EntriesOf(SUPPORTED_DTYPES, reason_as_a_list, own_parameters, parameters_listed_as_torch,
                         container_leaves, opens_nothing, False)
    entries, _, _ = reader.of([(torch.ones(2, device="meta"), "output")])
    (entry,) = entries
    assert isinstance(entry[2], list) and gc.is_tracked(entry) and gc.is_tracked(entries)


@needs_extension
def test_the_cpp_objects_that_hold_python_objects_take_part_in_garbage_collection():
    """HookCore (the tensors a read waits for) and EntriesOf (the callables it asks): a cycle
    through either is collected, as one through OutputGradients is (above)."""
    from overflow_fast.hooks.frames import container_leaves, opens_nothing, own_parameters, parameters_listed_as_torch
    from overflow_fast.stats import unreadable_reason
    from overflow_fast.stats.kinds import SUPPORTED_DTYPES

    class Holder:
        pass

    core_holder = Holder()
    core_holder.core = C.HookCore(8, 1 << 20, 16)
    tensor = torch.ones(2)
    tensor.holder = core_holder  # the tensor the core holds leads back to it
    core_holder.core.add([tensor], 0, True)  # read at once, and watched until the pass ends
    core_holder.core.add([torch.ones(3)], 1, False)  # held until it is read
    del tensor
    entries_holder = Holder()

    def own(module):  # a callable that leads back to the EntriesOf holding it
        return own_parameters(module) if entries_holder else []

    def opens(kind):  # so does a predicate asked once per type
        return opens_nothing(kind) if entries_holder else True

    entries_holder.reader = C.EntriesOf(SUPPORTED_DTYPES, unreadable_reason, own, parameters_listed_as_torch,
                                        container_leaves, opens, True)
    entries_holder.reader.forward(torch.nn.ReLU(), (object(),), torch.ones(1), {"cache": object()})
    assert gc.is_tracked(core_holder.core) and gc.is_tracked(entries_holder.reader)
    alive = weakref.ref(core_holder), weakref.ref(entries_holder)
    del core_holder, entries_holder, own, opens
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def _kept_fields(call, ids):
    """A kept call's fields, with the calls it names by their index in ``ids`` (id -> index)."""
    def named(other):
        return None if other is None else ids[id(other)]
    return (call.module, call.args, call.kwargs, call.versions, named(call.parent), call.grad_enabled, call.autocast,
            call.output, call.output_versions, named(call.root), call.rng is None, call.counts, call.ordinal,
            call.wraps, call.kept)


@needs_extension
def test_the_cpp_kept_call_is_culprit_s_field_for_field():
    from overflow_fast.replay.culprit import KeptCall, root_state, root_state_at_end

    native = hook_core.kept_call_class()
    assert native is C.KeptCall and native is not KeptCall
    rng = random.Random(11)
    modules = [torch.nn.Linear(2, 2) for _ in range(4)] + [torch.nn.parallel.DataParallel(torch.nn.Linear(2, 2))]
    seen = set()  # the rules the calls went through
    for _ in range(60):
        trees = {KeptCall: [], native: []}
        plan = []  # (module, parent index or None, args, kwargs, grad, root_state, output or None: not returned)
        for index in range(rng.randint(1, 12)):
            parent = rng.choice([None] + list(range(index))) if index else None
            args = tuple(_values(rng) for _ in range(rng.randint(0, 3)))
            kwargs = rng.choice([None, {}, {f"k{i}": _values(rng) for i in range(rng.randint(1, 2))}])
            output = rng.choice([_values(rng), (torch.ones(1), 3), [torch.ones(2)], 7, None])
            plan.append((rng.choice(modules if parent is None else modules[:4] + [plan[parent][0]] * 2), parent, args,
                         kwargs, rng.random() < 0.5, root_state if rng.random() < 0.8 else root_state_at_end, output))
        for cls, calls in trees.items():
            for module, parent, args, kwargs, grad, state, output in plan:
                with torch.set_grad_enabled(grad):
                    call = cls(module, args, kwargs, None if parent is None else calls[parent], {"cpu": torch.bfloat16},
                               state)
                if output is not None:
                    call.returned(output)
                calls.append(call)
        ids = [{id(call): i for i, call in enumerate(calls)} for calls in trees.values()]
        for python_call, cpp_call in zip(*trees.values()):
            parent = python_call.parent
            seen.add("wrapper" if python_call.wraps else "under a wrapper" if parent is not None and parent.wraps
                     else "hooked twice" if parent is not None and parent.module is python_call.module
                     else "called again" if python_call.ordinal else "first")
            assert _kept_fields(cpp_call, ids[1]) == _kept_fields(python_call, ids[0])
            assert cpp_call.root is not None and cpp_call.call_state() == python_call.call_state()
            assert cpp_call.changed() is python_call.changed() is False
            never_returned = python_call.output_versions is None
            assert cpp_call.output_changed() is python_call.output_changed() is never_returned
            if python_call.output is not None and isinstance(python_call.output, torch.Tensor) \
                    and python_call.output.dtype == torch.float32 and not python_call.output.is_inference():
                with torch.no_grad():
                    python_call.output.mul_(1)  # (the same tensor: both see it changed)
                assert cpp_call.output_changed() is python_call.output_changed() is True
            cpp_call.release()
            assert cpp_call.kept is False and cpp_call.args is None and cpp_call.output is None
    assert seen == {"wrapper", "under a wrapper", "hooked twice", "called again", "first"}
    with pytest.raises(TypeError, match="parent"):
        native(modules[0], (), None, object(), {}, root_state)


# -- a forward hook's one call: csrc/hooks.cpp's forward_call and its twin -----------------------------

def _forward_call_parts(native, containers, seen):
    """(forward_call, EntriesOf, OutputGradients, HookCore, KeptCall class) of one implementation."""
    from overflow_fast.replay.culprit import KeptCall

    def on_gradient(owner, grad):
        seen.append((owner[0](), owner[1], [consumer() for consumer in owner[2]], grad.clone()))

    if native:
        return (C.forward_call, hook_core.entries_reader(containers), C.OutputGradients(on_gradient, None),
                C.HookCore(6, 1 << 20, 1 << 16), hook_core.kept_call_class())
    return (hook_core.forward_call, hook_core.EntriesOf(containers), hook_core.OutputGradients(on_gradient, None),
            hook_core.HookCore(6, 1 << 20, 1 << 16), KeptCall)


@needs_extension
@pytest.mark.parametrize("containers", [False, True])
def test_the_cpp_forward_call_is_its_twin_s_call_for_call(containers):
    """Entries, rows (the core's answer), gradient hooks and the kept call's output: the same on both."""
    from overflow_fast.replay.culprit import root_state

    rng = random.Random(13 + containers)
    modules = [torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.LayerNorm(3)]
    base = torch.randn(3, 3, requires_grad=True)
    settled_in_all = 0
    for _ in range(30):
        plan = []
        made = []  # tensors of the calls before: a call may take or return one again (its rows then reused)
        for _ in range(rng.randint(1, 6)):
            args = tuple(_values(rng) if rng.random() < 0.3 else rng.choice(made) if made and rng.random() < 0.5
                         else base * rng.random() for _ in range(rng.randint(0, 2)))
            outputs = tuple(rng.choice(made) if made and rng.random() < 0.3 else base * rng.random()
                            if rng.random() < 0.6 else _values(rng) for _ in range(rng.randint(1, 3)))
            made.extend(value for value in outputs if type(value) is torch.Tensor)
            output = outputs if rng.random() < 0.5 else outputs[0]
            kwargs = rng.choice([None, {"k": base * 2}])
            plan.append((rng.choice(modules), args, output, kwargs, rng.choice([-1, 3]), rng.random() < 0.5,
                         rng.random() < 0.5, rng.random() < 0.8))
        answers, seen_by = [], []
        settled_calls = 0
        labels = Labels()
        for native in (True, False):
            seen = []
            call, entries_of, outputs, core, kept_class = _forward_call_parts(native, containers, seen)
            got = []
            for module, args, output, kwargs, site, waits_on_cpu, keep, hook in plan:
                kept = kept_class(module, args, kwargs, None, {}, root_state) if keep else None
                entries, tensors, dtypes, sources, answer = call(entries_of, module, args, output, kwargs,
                                                                 outputs if hook else None, kept, core, site,
                                                                 waits_on_cpu)
                for tensor in tensors:
                    labels.name(tensor, id(tensor))
                # settled: the sources alone; else the answer for the caller (both None: nothing added)
                assert sources is None or answer is None
                assert sources is None or (type(sources) is tuple and type(sources[1]) is tuple), sources
                settled_calls += sources is not None
                got.append((entries, [id(t) for t in tensors], dtypes, sources,
                            None if answer is None else normal(answer, labels),
                            None if kept is None else (kept.output is output, kept.output_versions)))
            answers.append(got)
            loss = sum(t.sum() for item in plan for t in _tensors_of(item[2]) if t.requires_grad)
            if torch.is_tensor(loss) and loss.requires_grad:
                loss.backward(retain_graph=True)
            outputs.clear()  # (the next implementation's backward runs these hooks again)
            seen_by.append(seen)
        assert answers[0] == answers[1]
        settled_in_all += settled_calls
        assert [(m, ctx, consumers) for m, ctx, consumers, _ in seen_by[0]] == \
            [(m, ctx, consumers) for m, ctx, consumers, _ in seen_by[1]]
        assert all(torch.equal(a[3], b[3]) for a, b in zip(*seen_by))
    assert settled_in_all > 0  # (the common answer was drawn)


def _tensors_of(output):
    values = output if isinstance(output, tuple) else (output,)
    return [value for value in values if type(value) is torch.Tensor]
