"""The public API is typed: the package carries py.typed, the functions and classes users call are
annotated, and mypy finds nothing in the modules that hold them."""

import inspect
import os

import pytest

import overflow_fast
from overflow_fast import DebugUnderflowOverflow, cli, watch
from overflow_fast.integrations import lightning, transformers
from overflow_fast.recording.recorder import Recorder

PACKAGE = os.path.dirname(overflow_fast.__file__)
PUBLIC_MODULES = ["__init__.py", "hooks/detector.py", "hooks/options.py", "integrations/transformers.py",
                  "integrations/lightning.py", "recording/recorder.py", "cli.py"]


def test_the_package_says_it_is_typed():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))


@pytest.mark.parametrize("function", [
    watch, DebugUnderflowOverflow.__init__, DebugUnderflowOverflow.remove, DebugUnderflowOverflow.set_step,
    DebugUnderflowOverflow.set_batch, DebugUnderflowOverflow.flush, overflow_fast.tensor_stats,
    transformers.DetectorCallback.__init__, transformers.use_in_trainer, lightning.DetectorCallback.__init__,
    Recorder.__init__, Recorder.write, cli.main,
], ids=lambda f: f.__qualname__)
def test_what_users_call_is_annotated(function):
    signature = inspect.signature(function)
    assert signature.return_annotation is not inspect.Signature.empty, function
    for name, parameter in signature.parameters.items():
        if name != "self":
            assert parameter.annotation is not inspect.Parameter.empty, (function, name)


def test_mypy_finds_nothing_in_the_public_modules():
    api = pytest.importorskip("mypy.api")
    root = os.path.dirname(PACKAGE)
    stdout, stderr, status = api.run(["--config-file", os.path.join(root, "pyproject.toml"),
                                      "--cache-dir", os.path.join(root, ".mypy_cache")]
                                     + [os.path.join(PACKAGE, module) for module in PUBLIC_MODULES])
    assert status == 0, stdout + stderr
