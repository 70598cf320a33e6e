"""The reproducer file: one module call's replay, written at a detection (``repro=``) and replayed in
another process (``overflow-fast replay FILE``)."""

import ast
import contextlib
import os
import pickle
import sys
import types
import warnings

import torch
import torch.utils._pytree as pytree

from ..distributed import local_shard
from .op_replay import replay_backward, replay_forward
from .sandbox import call_state, copied, without_hooks

REPRO_FORMAT = "overflow_fast reproducer"
REPRO_VERSION = 1

class ReproError(Exception):
    """A reproducer file that cannot be written or read; the message names it and says why."""


def repro_path(directory, rank, step):
    """``directory/overflow-rank<r>-step<s>.pt`` (rank 0 in a single process, step 0 unknown)."""
    return os.path.join(directory, f"overflow-rank{rank or 0}-step{step or 0}.pt")


def write_repro(directory, rank, step, module, args, kwargs, grad_outputs, detection, *, rng=None,
                call=None, target=None, name=None):
    """Write ``repro_path(directory, rank, step)`` with ``torch.save``: the module (pickled; no
    hook goes with it), copies of the call's inputs and keyword inputs, ``grad_outputs`` for a
    backward (None for a forward), ``rng`` (``rng_state()`` at the call), ``call``
    (``call_state()`` at the call; None: now), ``target`` (``(name of the submodule in module,
    "input" | "output")`` as ``replay_forward`` takes it, or None), ``name`` (the module's name in
    the model, what a replay's label names), the versions of torch and of this package, and the
    detection dict. Classes and functions of the training script itself
    (``__main__``) are written as references to that script's definitions (``script_definitions``),
    so the file replays in a fresh process; where that cannot work, a warning says so and names the
    fix. Returns the path; raises ``ReproError`` naming it when it cannot be written (nothing
    half-written is left)."""
    from .._version import __version__

    path = repro_path(directory, rank, step)
    partial = f"{path}.{os.getpid()}.partial"
    distributed_reason = _held_across_ranks(module, args, kwargs)
    if distributed_reason is not None:
        raise ReproError(f"cannot write the reproducer {path}: {distributed_reason}")
    pickling = _ScriptPickling()
    try:
        payload = {
            "format": REPRO_FORMAT, "format_version": REPRO_VERSION,
            "phase": "forward" if grad_outputs is None else "backward",
            "module": module, "args": copied(tuple(args)), "kwargs": copied(dict(kwargs or {})),
            "grad_outputs": None if grad_outputs is None else copied(list(grad_outputs), requires_grad=False),
            "rng": rng, "call": call if call is not None else call_state(), "target": target,
            "torch_version": torch.__version__, "overflow_fast_version": __version__,
            "rank": rank, "step": step, "detection": detection, "name": name,
        }
        os.makedirs(directory, exist_ok=True)
        with without_hooks(module):  # the detector's hooks are not the model's
            torch.save(payload, partial, pickle_module=pickling)
        os.replace(partial, path)
    except Exception as error:
        with contextlib.suppress(OSError):
            os.remove(partial)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        raise ReproError(f"cannot write the reproducer {path}: {reason}") from error
    problem = pickling.problem()
    if problem is not None:
        warnings.warn(f"overflow_fast: the reproducer {path} will not replay in a fresh process: {problem}",
                      RuntimeWarning, stacklevel=2)
    return path


def _held_across_ranks(module, args, kwargs):
    """Why a call cannot replay in one process on its own (a reproducer's), or None: DTensors need
    their process group, and FSDP2's classes and hooks cannot be pickled."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:
        FSDPModule = ()
    tensors = list(module.parameters()) + list(module.buffers()) + pytree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and local_shard(t) is not t for t in tensors):
        return "the call's tensors are DTensors, held across ranks, and a reproducer replays in one process"
    if FSDPModule and any(isinstance(m, FSDPModule) for m in module.modules()):
        return "FSDP2's fully_shard gave the module a class and hooks of its own, which a file cannot hold"
    return None


class _Reading:
    """``torch.load``'s pickle module for a reproducer: a file written when this module lived in
    ``overflow_fast.hooks.op_replay`` refers to its functions there."""

    __name__ = "pickle"

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "overflow_fast.hooks.op_replay":
                module = __name__
            return super().find_class(module, name)

    @staticmethod
    def load(file, **options):
        return _Reading.Unpickler(file, **options).load()


def load_repro(path, map_location=None):
    """The dict ``write_repro`` saved. Loading a pickle runs code: load only files you trust.
    Raises ``ReproError`` naming the file when it cannot be read or is not a reproducer."""
    try:
        payload = torch.load(path, map_location=map_location, weights_only=False, pickle_module=_Reading)
    except Exception as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        raise ReproError(f"cannot read the reproducer {path}: {reason}") from error
    if not isinstance(payload, dict) or payload.get("format") != REPRO_FORMAT:
        raise ReproError(f"{path} is not an overflow_fast reproducer")
    if payload.get("format_version") != REPRO_VERSION:
        raise ReproError(f"{path} is a reproducer of format {payload.get('format_version')}; "
                         f"this overflow_fast reads format {REPRO_VERSION}")
    return payload


def replay_repro(payload):
    """Replay what a loaded reproducer holds; the result of ``replay_forward``/``replay_backward``."""
    module, args, kwargs = payload["module"], payload["args"], payload["kwargs"]
    options = {"rng": payload.get("rng"), "call": payload.get("call")}
    if payload["phase"] == "backward":
        return replay_backward(module, args, kwargs, payload["grad_outputs"], **options)
    target = payload.get("target")
    if target is not None:
        name, side = target
        options["target"] = (module.get_submodule(name), side)
    return replay_forward(module, args, kwargs, **options)


# -- the training script's own classes in a reproducer -----------------------------------------------
#
# A class defined in the script being run lives in ``__main__``, which pickle writes by reference:
# in another process ``__main__`` is another program. The file refers to the script instead, and a
# fresh process runs the script's definitions alone (its imports, classes, functions and constant
# assignments), never the training the rest of it runs.

_SCRIPTS = {}  # (path, package) -> the module of a script's definitions, loaded once per process


def _main_script():
    """(path, package) of the script running as ``__main__``, or None (an interactive session)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return None
    spec = getattr(main, "__spec__", None)
    package = spec.parent if spec is not None and spec.parent else None
    return os.path.abspath(path), package


class _ScriptPickling:
    """``torch.save``'s pickle module: writes the ``__main__`` classes and functions it meets as
    ``script_definition(script, qualified name)``; ``problem()`` says why the file could still not
    replay elsewhere (None when it can)."""

    def __init__(self):
        self.__name__ = "pickle"
        self.script = _main_script()
        self.names = []  # the qualified names of the __main__ objects written
        pickling = self

        class Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                # (a lambda or a class defined inside a function cannot be referred to: pickle says so)
                if (isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__"
                        and "<" not in obj.__qualname__):
                    if obj.__qualname__ not in pickling.names:
                        pickling.names.append(obj.__qualname__)
                    if pickling.script is not None:
                        return script_definition, (pickling.script, obj.__qualname__)
                return NotImplemented

        self.Pickler = Pickler

    def problem(self):
        if not self.names:
            return None
        defined = ", ".join(self.names)
        if self.script is None:
            return (f"{defined} are defined in an interactive session (__main__ has no file): define them in a "
                    "module and import them")
        try:
            with open(self.script[0], encoding="utf-8") as source:
                tree = ast.parse(source.read(), self.script[0])
        except (OSError, SyntaxError, ValueError) as error:
            return f"cannot read the script {self.script[0]} that defines {defined}: {error}"
        missing = _not_defined(tree, self.names)
        if missing:
            return (f"{', '.join(missing)} in {self.script[0]} are not top-level definitions, or read names that "
                    "the script sets by running code (a replay runs only its imports, classes, functions and "
                    "assignments that call nothing): define them in a module and import them")
        return None


def _definitions(tree):
    """The top-level statements of a script that only define: imports, classes, functions and
    assignments that call nothing (``if __name__ == "__main__":`` and the training loop are left out)."""
    kept = []
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kept.append(statement)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None and not any(
                isinstance(node, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr))
                for node in ast.walk(statement.value)):
            kept.append(statement)
    return kept


def _bound_names(statement):
    if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return {node.id for target in targets if target is not None for node in ast.walk(target)
            if isinstance(node, ast.Name)}


def _not_defined(tree, names):
    """Those of ``names`` (qualified) that the script's definitions do not give, or whose code
    reads a top-level name that only the rest of the script sets."""
    kept = _definitions(tree)
    defined = {name for statement in kept for name in _bound_names(statement)}
    run_only = {name for statement in tree.body if statement not in kept for name in _bound_names(statement)
                if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign))} - defined
    by_name = {statement.name: statement for statement in kept if hasattr(statement, "name")}
    missing = []
    for name in names:
        top = name.split(".")[0]
        statement = by_name.get(top)
        if top not in defined or (statement is not None and any(
                isinstance(node, ast.Name) and node.id in run_only for node in ast.walk(statement))):
            missing.append(name)
    return missing


def script_definition(script, qualname):
    """The class or function ``qualname`` of a training script, from its definitions alone (what a
    reproducer refers to instead of ``__main__``). ``script``: (path, package)."""
    module = _SCRIPTS.get(script)
    if module is None:
        module = _SCRIPTS[script] = _load_definitions(*script)
    value = module
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _load_definitions(path, package):
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError) as error:
        raise ReproError(f"cannot read the training script {path} whose classes the reproducer holds: {error}") \
            from error
    name = f"__overflow_fast_script_{len(_SCRIPTS)}__"
    module = types.ModuleType(name)
    module.__file__ = path
    module.__package__ = package
    sys.modules[name] = module  # dataclasses and pickle look classes' modules up there
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)  # the script's own imports of its neighbours
    try:
        code = compile(ast.Module(body=_definitions(tree), type_ignores=[]), path, "exec")
        exec(code, module.__dict__)  # noqa: S102 - the definitions of a script the user trusts, as a pickle is
    finally:
        if added:
            sys.path.remove(folder)
    return module
