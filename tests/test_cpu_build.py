"""The C++ kernel's build on first use (overflow_fast/stats/cpu_build.py): the cache key, the
instruction set chosen, the lock that makes concurrent processes build once, a failed build's one
warning and the fallback, and `overflow-fast info`. Nothing here compiles the kernel (real builds
are the slow tests and .ci/run's)."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import overflow_fast
from overflow_fast import cli
from overflow_fast.info import info
from overflow_fast.stats import cpu_backend, cpu_build, dispatch

ROOT = Path(__file__).resolve().parents[1]
CPU_BUILD = ROOT / "overflow_fast" / "stats" / "cpu_build.py"


def copy_sources(tmp_path):
    target = tmp_path / "csrc"
    shutil.copytree(cpu_build.sources_dir(), target)
    return target


def test_the_kernel_of_these_sources_loads_where_a_compiler_is():
    """Where a C++ compiler is, the extension of these very sources builds and loads: a C++ error in
    csrc/ fails the suite here, rather than skipping every test that needs the extension and
    running the rest on the Python twins."""
    if os.environ.get(cpu_build.WITHOUT_ENV, "") not in ("", "0"):
        pytest.skip(f"{cpu_build.WITHOUT_ENV} asks to run without the extension")
    if shutil.which(cpu_build.compiler()) is None:
        pytest.skip(f"no C++ compiler ({cpu_build.compiler()})")
    assert cpu_backend.extension() is not None, cpu_backend.unavailable_reason()


# ---- the cache key ----------------------------------------------------------------------------

def test_every_part_of_the_identity_gives_a_new_build_directory(tmp_path, monkeypatch):
    sources = copy_sources(tmp_path)
    base = cpu_build.identity("avx2", sources)
    key = cpu_build.cache_key(base)
    assert cpu_build.cache_key(cpu_build.identity("avx2", sources)) == key  # stable
    assert base["torch"] == torch.__version__ and base["cxx11_abi"] == int(torch._C._GLIBCXX_USE_CXX11_ABI)

    (sources / "kernel.h").write_text((sources / "kernel.h").read_text() + "\n// changed\n")
    changed_source = cpu_build.cache_key(cpu_build.identity("avx2", sources))
    other_isa = cpu_build.cache_key(cpu_build.identity("avx512", sources))
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    other_torch = cpu_build.cache_key(cpu_build.identity("avx2", sources))
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    other_abi = cpu_build.cache_key(cpu_build.identity("avx2", sources))
    keys = [key, changed_source, other_isa, other_torch, other_abi]
    assert len(set(keys)) == len(keys), keys
    assert "2.99.0" in other_torch and other_isa.startswith("avx512-")

    # an added source file changes the hash too (the build globs csrc/*.cpp)
    (sources / "extra.cpp").write_text("// new unit\n")
    assert cpu_build.cache_key(cpu_build.identity("avx2", sources)) not in keys


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cpu_build.CACHE_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_build.cache_root() == tmp_path / "xdg" / "torch_extensions" / "overflow_fast"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert cpu_build.cache_root() == tmp_path / "torch" / "overflow_fast"
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "mine"))
    assert cpu_build.cache_root() == tmp_path / "mine"


def test_translation_units_are_found_by_glob(tmp_path):
    sources = copy_sources(tmp_path)
    (sources / "added.cpp").write_text("// a unit nobody listed\n")
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    units = [Path(u).name for u in cpu_build.translation_units("avx512", sources, build_dir)]
    assert "added.cpp" in units and "binding.cpp" in units
    assert "kernel_avx2.cpp" not in units and "kernel_avx512.cpp" not in units
    assert units[-2:] == ["isa_kernel_avx512.cpp", "kernel_default.cpp"]
    assert '#include "kernel_avx512.cpp"' in (build_dir / "isa_kernel_avx512.cpp").read_text()
    baseline = [Path(u).name for u in cpu_build.translation_units("baseline", sources, build_dir)]
    assert not any(name.startswith("isa_") for name in baseline) and baseline[-1] == "kernel_default.cpp"


# ---- the instruction set ----------------------------------------------------------------------

@pytest.mark.parametrize("flags, cap, want", [
    ({"avx2", "fma", "f16c", "popcnt", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, None, "avx512"),
    ({"avx2", "fma", "f16c", "popcnt", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2", "avx2"),
    ({"avx2", "fma", "f16c", "popcnt", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "default", "baseline"),
    ({"avx2", "fma", "f16c", "popcnt", "avx512f"}, None, "avx2"),  # AVX-512 without BW/VL/DQ
    ({"avx2", "fma", "f16c", "popcnt"}, "avx512", "avx2"),  # the cap never raises the choice
    ({"avx", "sse4_2"}, None, "baseline"),
    ({"avx2", "f16c", "popcnt"}, None, "baseline"),  # no FMA
])
def test_instruction_set_from_the_cpu_flags(monkeypatch, flags, cap, want):
    monkeypatch.setattr(cpu_build, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    if cap is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    assert cpu_build.detect_isa() == want


def test_not_x86_builds_the_baseline(monkeypatch):
    monkeypatch.setattr(cpu_build, "_is_x86", lambda: False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert cpu_build.detect_isa() == "baseline"


# ---- one build at a time ----------------------------------------------------------------------

# A process that builds through cpu_build.obtain with a stand-in build: it says "building", then
# waits for a line on stdin (the test decides when it ends; no clock), and fails if told "fail".
_WORKER = textwrap.dedent("""
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
    cpu_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_build)
    root, key, count = sys.argv[2], sys.argv[3], sys.argv[4]

    def build(directory):
        os.makedirs(directory, exist_ok=True)
        with open(count, "a") as f:
            f.write(f"{os.getpid()}\\n")
        print("building", flush=True)
        if sys.stdin.readline().strip() == "fail":
            raise cpu_build.BuildError("x.cpp:1:1: error: deliberately broken")
        with open(os.path.join(directory, "_C.so"), "w") as f:
            f.write("stand-in")
        return {"seconds": 0}

    directory, reason, built = cpu_build.obtain(root, key, build)
    print("RESULT " + json.dumps([str(directory) if directory else None, reason, built]), flush=True)
""")


def _start_worker(tmp_path):
    return subprocess.Popen([sys.executable, "-c", _WORKER, str(CPU_BUILD), str(tmp_path / "cache"), "key",
                             str(tmp_path / "count")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    line = [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), err


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_two_processes_starting_together_build_once(tmp_path, outcome):
    first = _start_worker(tmp_path)
    assert first.stdout.readline().strip() == "building"  # it holds the lock, inside its build
    second = _start_worker(tmp_path)
    # the second one blocks on the lock and says so (one line), before the first is let go
    line = second.stderr.readline()
    assert "waiting for another process building the C++ kernel" in line, line
    first.stdin.write(f"{outcome}\n")
    first.stdin.flush()
    (directory, reason, built), first_err = _result(first)
    (directory2, reason2, built2), second_err = _result(second)
    assert "building the C++ kernel" in first_err
    assert built is True and built2 is False
    assert len((tmp_path / "count").read_text().split()) == 1  # one build for the two
    # the end of the wait is said too, one line
    done = [line for line in second_err.splitlines() if line.startswith("overflow_fast: done waiting (")]
    assert len(done) == 1, second_err
    if outcome == "ok":
        assert reason is None and reason2 is None and directory == directory2
        assert (Path(directory) / cpu_build.DONE).is_file()
        # the end of the build: how long it took (a whole number of seconds) and the module's path
        library = Path(directory) / "_C.so"
        assert re.search(rf"^overflow_fast: built the C\+\+ kernel in \d+ s: {re.escape(str(library))}$",
                         first_err, re.M), first_err
        assert done[0].endswith(f" s): the other process built the C++ kernel: {library}"), done
        assert not (tmp_path / "cache" / "key.failed").exists()
        # later processes take the finished build without the lock or a message
        third = _start_worker(tmp_path)
        (directory3, _, built3), third_err = _result(third)
        assert directory3 == directory and built3 is False and third_err == ""
    else:
        # the waiting process takes the failure it waited for instead of failing once more
        assert done[0].endswith(" s): the other process could not build the C++ kernel"), done
        assert "built the C++ kernel" not in first_err
        assert directory is None and directory2 is None
        assert reason == reason2 == "x.cpp:1:1: error: deliberately broken"
        # a later process tries again (a compiler installed since may fix it)
        third = _start_worker(tmp_path)
        assert third.stdout.readline().strip() == "building"
        third.stdin.write("ok\n")
        third.stdin.flush()
        (directory3, reason3, built3), _ = _result(third)
        assert reason3 is None and built3 is True
        assert len((tmp_path / "count").read_text().split()) == 2


# ---- a failed build ---------------------------------------------------------------------------

def test_first_error_line():
    log = ("Error building extension '_C': [1/3] c++ -c a.cpp\nFAILED: [code=1] b.o\nc++ -c b.cpp -o b.o\n"
           "In file included from b.cpp:3:\nb.cpp:7:5: error: 'foo' was not declared in this scope\n"
           "b.cpp:9:1: error: expected ';'\nninja: build stopped: subcommand failed.\n")
    assert cpu_build.first_error_line(log) == "b.cpp:7:5: error: 'foo' was not declared in this scope"
    # a compiler that fails without a word (CXX=false): ninja's failed step
    log = "FAILED: [code=1] binding.o\nfalse -MMD -c binding.cpp\nninja: build stopped: subcommand failed.\n"
    assert cpu_build.first_error_line(log) == "FAILED: [code=1] binding.o"


def test_a_broken_source_fails_with_the_compilers_first_error(tmp_path):
    if shutil.which(cpu_build.compiler()) is None:
        pytest.skip("no C++ compiler")
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "binding.cpp").write_text("#error deliberately broken source\n")
    (sources / "kernel_default.cpp").write_text("int unused;\n")
    with pytest.raises(cpu_build.BuildError, match=r"binding\.cpp:1:2: error: #error deliberately broken source"):
        cpu_build.build("baseline", tmp_path / "build", sources)
    assert "deliberately broken source" in (tmp_path / "build" / cpu_build.LOG).read_text()


def test_a_build_shows_the_units_it_compiled_and_the_time_so_far(tmp_path, monkeypatch, capfd):
    if shutil.which(cpu_build.compiler()) is None:
        pytest.skip("no C++ compiler")
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "binding.cpp").write_text("int one() { return 1; }\n")
    (sources / "kernel_default.cpp").write_text("int two() { return 2; }\n")
    monkeypatch.setattr(cpu_build, "PROGRESS_EVERY", 0.0)  # a line at every look, not only when a unit ends
    monkeypatch.setattr(cpu_build, "PROGRESS_LOOK", 0.01)
    cpu_build.build("baseline", tmp_path / "build", sources)
    lines = [line for line in capfd.readouterr().err.splitlines() if "units compiled" in line]
    counts = [re.match(r"overflow_fast: building the C\+\+ kernel: (\d) of 2 units compiled(, linking)? \(\d+ s\)$",
                       line) for line in lines]
    assert lines and all(counts), lines
    done = [int(match.group(1)) for match in counts]
    assert done == sorted(done)  # units done only grow


def test_no_compiler_is_said_plainly(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_build.BuildError, match="no C\\+\\+ compiler: .*no-such-compiler.* is not on PATH"):
        cpu_build.build("baseline", tmp_path / "build")


def test_ninja_from_the_environment_when_not_on_path(tmp_path, monkeypatch):
    # a virtual environment used without activating it: its bin/ holds pip's ninja, PATH does not
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").write_text("#!/bin/sh\n")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_build.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setitem(sys.modules, "ninja", None)
    assert cpu_build._ninja_dir() == str(bin_dir)


_FALLBACK = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    import torch, overflow_fast
    from overflow_fast import tensor_stats
    from overflow_fast.stats import cpu_backend
    x = torch.tensor([1.0, float("inf"), -3.0])
    rows = [tensor_stats([x]).tolist()[0] for _ in range(3)]
    assert rows[0]["posinf"] == 1 and rows[0]["abs_max"] == float("inf"), rows
    facts = overflow_fast.info()
    print("KERNEL " + facts["cpu_kernel"])
    print("CPU " + facts["default_backend"]["cpu"])
""")


def _run_fallback(tmp_path, **env):
    environment = {**os.environ, cpu_build.CACHE_ENV: str(tmp_path / "cache"), **env}
    environment.pop("OVERFLOW_FAST_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, env=environment,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    return proc, warned


def test_a_failed_build_warns_once_naming_the_error_and_the_fallback(tmp_path):
    """CXX=false: a compiler that fails without a word. Import, three tensor_stats calls and
    info(): one warning, with the first error, the log, the fix and the 'torch' backend."""
    proc, warned = _run_fallback(tmp_path, CXX="false")
    assert len(warned) == 1, proc.stderr
    message = warned[0]
    # torch's check of the compiler's version fails before ninja runs: that is the first error
    assert "the C++ kernel could not be built: Command '['false', '--version']' returned non-zero" in message
    assert "full log: " + str(tmp_path / "cache") in message
    assert "falling back to the slower 'torch' backend" in message
    assert "OVERFLOW_FAST_AOT=1 pip install --no-build-isolation -e ." in message  # a checkout's fix
    assert message.count("OVERFLOW_FAST_AOT=1") == 1  # the reason holds the fix: not said twice
    assert "costs more overhead than with the kernel (measured in benchmarks/RESULTS.md" in message
    assert "circular import" not in proc.stderr and "make setup" not in proc.stderr
    assert "KERNEL unavailable (the C++ kernel could not be built: Command '['false'" in proc.stdout
    assert "CPU torch (the C++ kernel is unavailable)" in proc.stdout
    assert len(list((tmp_path / "cache").glob("*/" + cpu_build.LOG))) == 1
    # the line that said it was building is followed by one that says how it ended
    building = [line for line in proc.stderr.splitlines() if "building the C++ kernel" in line]
    ended = [line for line in proc.stderr.splitlines() if "could not build the C++ kernel" in line]
    assert len(building) == 1 and len(ended) == 1 and "Command '['false', '--version']'" in ended[0], proc.stderr


def test_no_build_when_told_not_to(tmp_path):
    proc, warned = _run_fallback(tmp_path, OVERFLOW_FAST_JIT="0")
    assert len(warned) == 1 and "OVERFLOW_FAST_JIT=0 forbids building one" in warned[0], proc.stderr
    assert not list((tmp_path / "cache").glob("*/*"))


def test_the_fix_fits_how_the_package_was_installed(monkeypatch):
    monkeypatch.setattr(cpu_build, "installed_from_checkout", lambda: True)
    assert "pip install --no-build-isolation -e ." in cpu_build._fix_hint()
    monkeypatch.setattr(cpu_build, "installed_from_checkout", lambda: False)
    hint = cpu_build._fix_hint()
    assert "install a C++ compiler (g++) and ninja" in hint and "-e ." not in hint
    assert "OVERFLOW_FAST_AOT=1 pip install --no-build-isolation overflow_fast" in hint


# ---- the fallback inside this process ---------------------------------------------------------

@pytest.fixture
def fresh_cpu_backend(monkeypatch):
    """cpu_backend and dispatch as before their first use; the real ones come back afterwards."""
    monkeypatch.setattr(cpu_backend, "_state", None)
    monkeypatch.setattr(cpu_backend, "_compute", None)
    monkeypatch.setattr(dispatch, "_loaded", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_choices", {})
    monkeypatch.delenv("OVERFLOW_FAST_BACKEND", raising=False)


def _falls_back_with_one_warning(match):
    x = torch.tensor([1.0, float("nan"), -3.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = dispatch.tensor_stats([x]).tolist()
        second = dispatch.tensor_stats([x]).tolist()
        assert cpu_backend.extension() is None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "falling back to the slower 'torch' backend" in messages[0] and match in messages[0], messages[0]
    assert first[0]["nan"] == second[0]["nan"] == 1 and first[0]["abs_max"] != first[0]["abs_max"]
    with pytest.raises(RuntimeError, match="unavailable"):
        dispatch.tensor_stats([x], backend="cpu")
    return messages[0]


def test_fallback_when_loading_raises(monkeypatch, fresh_cpu_backend):
    def broken(path):
        raise OSError("undefined symbol: _ZN2at6Tensor")

    monkeypatch.setattr(cpu_build, "load_module", broken)
    message = _falls_back_with_one_warning("could not be loaded (OSError: undefined symbol")
    assert "to rebuild it" in message
    # what the fallback costs, and the fix for this installation once (the reason lacks it)
    assert "costs more overhead than with the kernel (measured in benchmarks/RESULTS.md" in message
    assert message.count(cpu_build._fix_hint()) == 1


def test_fallback_when_built_against_another_torch(monkeypatch, fresh_cpu_backend):
    class Stale:
        __file__ = "/somewhere/_C.so"
        ABI_VERSION = cpu_backend.ABI_VERSION
        TORCH_VERSION = "1.0.0"

    monkeypatch.setattr(cpu_build, "load", lambda: (Stale(), None, {"cache_root": "/somewhere"}))
    _falls_back_with_one_warning("built against torch 1.0.0")


def test_fallback_when_the_interface_version_differs(monkeypatch, fresh_cpu_backend):
    class Old:
        __file__ = "/somewhere/_C.so"
        ABI_VERSION = cpu_backend.ABI_VERSION - 1
        TORCH_VERSION = torch.__version__

    monkeypatch.setattr(cpu_build, "load", lambda: (Old(), None, {"cache_root": "/somewhere"}))
    _falls_back_with_one_warning(f"interface version {cpu_backend.ABI_VERSION - 1}")


# ---- overflow-fast info -----------------------------------------------------------------------

INFO_KEYS = {"overflow_fast", "python", "torch", "triton", "cpu_kernel", "cpu_kernel_file", "cpu_kernel_origin",
             "cpu_kernel_cache", "log_reader", "default_backend", "cuda_devices", "per_hook_read", "direct_launch",
             "environment"}


def test_info_keys():
    facts = overflow_fast.info()
    assert set(facts) == INFO_KEYS
    assert facts["torch"].startswith(torch.__version__ + " ")
    assert facts["triton"] == getattr(sys.modules.get("triton"), "__version__", facts["triton"])
    assert isinstance(facts["cuda_devices"], list) and isinstance(facts["environment"], dict)
    assert set(facts["default_backend"]) == {"cpu", "cuda", "other"}
    reason = cpu_backend.unavailable_reason()
    if reason is None:
        assert facts["cpu_kernel"] in ("avx512", "avx2", "baseline")
        assert facts["cpu_kernel"] == {"default": "baseline"}.get(cpu_backend._C.capability(), cpu_backend._C.capability())
        assert Path(facts["cpu_kernel_file"]).is_file()
        assert facts["default_backend"]["cpu"] == "cpu"
    else:
        assert facts["cpu_kernel"] == f"unavailable ({reason})"


def test_info_names_the_cache_in_use_and_why_the_configured_one_is_not(monkeypatch, fresh_cpu_backend):
    class Kernel:
        __file__ = "/home/me/.cache/torch_extensions/overflow_fast/key/_C.so"
        ABI_VERSION = cpu_backend.ABI_VERSION
        TORCH_VERSION = torch.__version__
        compute = None

        @staticmethod
        def set_zero3_released(test):
            pass

        @staticmethod
        def capability():
            return "avx2"

    details = {"cache_root": "/home/me/.cache/torch_extensions/overflow_fast", "origin": "cache",
               "path": Kernel.__file__, "seconds": 48.0, "built_now": True,
               "cache_rejected": "/shared/cache is writable by its group and others (owner me, mode drwxrwxrwx 0777)"}
    monkeypatch.setattr(cpu_build, "load", lambda: (Kernel(), None, details))
    facts = info()
    assert facts["cpu_kernel_cache"] == ("/home/me/.cache/torch_extensions/overflow_fast (the configured one is "
                                         "not private: /shared/cache is writable by its group and others "
                                         "(owner me, mode drwxrwxrwx 0777))")
    assert facts["cpu_kernel_file"] == Kernel.__file__ and facts["cpu_kernel_origin"] == "built just now in 48 s"


def test_info_command_prints_one_fact_a_line(capsys, monkeypatch):
    monkeypatch.setenv("OVERFLOW_FAST_BACKEND", "torch")
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    facts = info()
    assert f"torch: {facts['torch']}" in lines and f"triton: {facts['triton']}" in lines
    assert f"cpu kernel: {facts['cpu_kernel']}" in lines
    assert "default backend (cpu): torch (OVERFLOW_FAST_BACKEND)" in lines
    assert "environment: OVERFLOW_FAST_BACKEND=torch" in lines
    assert any(line.startswith("cuda devices: ") for line in lines)
    assert all(": " in line for line in lines)


def test_python_dash_m_info():
    # the cache directory stays (a different one would build again)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERFLOW_FAST_") or k == cpu_build.CACHE_ENV}
    proc = subprocess.run([sys.executable, "-m", "overflow_fast", "info"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if cpu_build.CACHE_ENV in env:
        assert f"environment: {cpu_build.CACHE_ENV}={env[cpu_build.CACHE_ENV]}" in proc.stdout
    else:
        assert "environment: no OVERFLOW_FAST_* variable set" in proc.stdout
    kernel = [line for line in proc.stdout.splitlines() if line.startswith("cpu kernel: ")]
    assert kernel and kernel[0] == f"cpu kernel: {info()['cpu_kernel']}"
