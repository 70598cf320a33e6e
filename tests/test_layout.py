"""The package's folders are its architecture: imports flow one way, and few modules sit at the top."""

import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overflow_fast")

# what each folder may import from the rest of the package
ALLOWED = {
    "stats": set(),
    "distributed": {"stats"},
    "recording": {"stats", "distributed"},
    "replay": {"stats", "distributed"},
    "hooks": {"stats", "distributed", "recording", "replay"},
    "report": {"recording"},
}
# the differences between torch versions (it imports torch only), the package's version and the
# cache of compiled modules (standard library only): every folder may use them
EVERYWHERE = {"_compat", "_version", "build_cache"}


def imported_folders(path, folder):
    """The package's top-level folders or modules that the file at ``path`` imports (any depth)."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level == 1:
                    continue  # its own folder
                parts = (node.module or "").split(".")
                names = [parts[0]] if parts[0] else [alias.name for alias in node.names]
            elif (node.module or "").startswith("overflow_fast."):
                names = [node.module.split(".")[1]]
            else:
                continue
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("overflow_fast."))
    return found - {folder}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_flow_one_way(folder):
    for name in sorted(os.listdir(os.path.join(PACKAGE, folder))):
        if name.endswith(".py"):
            used = imported_folders(os.path.join(PACKAGE, folder, name), folder)
            allowed = ALLOWED[folder] | EVERYWHERE
            assert used <= allowed, f"{folder}/{name} imports {sorted(used - allowed)}"


@pytest.mark.parametrize("module", sorted(EVERYWHERE))
def test_what_every_folder_may_import_imports_nothing_of_the_package(module):
    tree = ast.parse(open(os.path.join(PACKAGE, f"{module}.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not node.level and not (node.module or "").startswith("overflow_fast"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(alias.name.startswith("overflow_fast") for alias in node.names)


def test_at_most_ten_modules_at_the_top():
    modules = [name for name in os.listdir(PACKAGE) if name.endswith(".py")]
    assert len(modules) <= 10, sorted(modules)


def test_the_hook_layers_frame_has_the_shape_the_recording_reads():
    from typing import get_type_hints

    from overflow_fast.hooks.frames import Frame
    from overflow_fast.recording.schema import RecordedFrame

    declared = set(get_type_hints(RecordedFrame))
    assert declared and declared <= set(Frame.__slots__)
    frame = Frame("fc", "Linear", [], [])
    assert all(hasattr(frame, name) for name in declared)  # each set when a frame is made


CSRC = os.path.join(os.path.dirname(PACKAGE), "csrc")
HOOK_LAYER_SOURCES = {"hook_layer.h", "hooks.cpp"}


def _includes(name):
    text = open(os.path.join(CSRC, name)).read()
    return {line.split('"')[1] for line in text.splitlines() if line.startswith('#include "')}


def test_the_hook_layers_cpp_is_apart_from_the_engines():
    """The hook layer's C++ reaches the engine through launch.h alone; the engine's C++ includes none of
    it (binding.cpp only registers it as the submodule ``hooks``); in Python only hooks/hook_core.py
    opens that submodule, and stats/ never names it."""
    for name in sorted(os.listdir(CSRC)):
        if not name.endswith((".cpp", ".h")):
            continue
        included = _includes(name)
        if name in HOOK_LAYER_SOURCES:
            assert included <= HOOK_LAYER_SOURCES | {"launch.h"}, f"{name} includes {sorted(included)}"
        elif name != "binding.cpp":
            assert not included & HOOK_LAYER_SOURCES, f"the engine's {name} includes the hook layer's C++"
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                opens = re.search(r"(\)|\bmodule|\b_C|\bC)\.hooks\b", text) is not None
                assert not opens or path.endswith(os.path.join("hooks", "hook_core.py")), path
                if os.path.join(PACKAGE, "stats") in path:
                    for name_of_the_hook_layer in ("HookCore", "OutputGradients", "EntriesOf"):
                        assert name_of_the_hook_layer not in text, f"{path} names {name_of_the_hook_layer}"


def _import_graph():
    """{module: the package's modules it imports, anywhere in its file (an import inside a function
    too: it only hides a cycle)}; ``from . import name`` counts as the submodule where there is
    one, else as the package's ``__init__``."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = ["overflow_fast", *os.path.relpath(path[:-3], PACKAGE).split(os.sep)]
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[module] = {name for name in found if name in modules and name != module}
    return graph


def test_no_import_cycle_and_no_module_imports_the_package_s_init():
    """Imports flow one way inside the package too: no module reaches itself again through its
    imports, and none imports the package's ``__init__`` (which imports ``info``), but the demo,
    written as a user writes it (nothing the package's ``__init__`` imports reaches it)."""
    graph = _import_graph()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            assert state.get(imported) != "open", "import cycle: " + " -> ".join(path + [imported])
            if imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    for module, imported in graph.items():
        assert "overflow_fast" not in imported or module == "overflow_fast.demo", f"{module} imports overflow_fast/__init__"
