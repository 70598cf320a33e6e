"""Where the C++ CPU kernel (``overflow_fast._C``) comes from: a prebuilt copy in the package, or a
build made here on first use, as DeepSpeed's ops are.

The build is ``torch.utils.cpp_extension.load`` (ninja, the translation units in parallel) of the
sources shipped in the package (``overflow_fast/csrc``; in a checkout, ``csrc/``), for the torch in
this environment and for this CPU's instruction set only (``baseline``, ``avx2`` or ``avx512``,
read from /proc/cpuinfo and capped by ATen's own ``ATEN_CPU_CAPABILITY``). Every build has its
own directory under the cache root, named by its key: instruction set, torch version, C++ ABI,
Python and a hash of the sources; a module is never rebuilt in place, and one built for other
sources or another torch is never loaded. Builds are serialised across processes by a file lock:
eight ranks starting together build once, the others wait for it and load its result.

Loading a module runs its code, so a module is loaded only from folders that nobody but this user
(and root) can change, and only once its bytes match the checksum its build recorded: see "trust"
below. A cache that fails the first check is not used (another private folder is); a build that
fails the second (cut short, overwritten, made by an older version) is made again.

Stdlib at import (torch only once a build or a load is asked for), so that setup.py can load this
file on its own for an ahead-of-time build (``OVERFLOW_FAST_AOT``).
"""

import functools
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    from .. import build_cache
    from .source_hash import source_hash
except ImportError:  # loaded on its own, by path (setup.py)
    def _load_alone(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    build_cache = _load_alone("_overflow_fast_build_cache", Path(__file__).parents[1] / "build_cache.py")
    source_hash = _load_alone("_overflow_fast_source_hash", Path(__file__).with_name("source_hash.py")).source_hash

# the cache's names, and its functions bound to the kernel
BuildError, CACHE_ENV, DONE, JIT_ENV, LOG, PACKAGE, PREBUILT, WITHOUT_ENV = (
    build_cache.BuildError, build_cache.CACHE_ENV, build_cache.DONE, build_cache.JIT_ENV, build_cache.LOG,
    build_cache.PACKAGE, build_cache.PREBUILT, build_cache.WITHOUT_ENV)
cache_folder, cache_root, default_cache_root, first_error_line, private_folder, write_build_record = (
    build_cache.cache_folder, build_cache.cache_root, build_cache.default_cache_root, build_cache.first_error_line,
    build_cache.private_folder, build_cache.write_build_record)
_say, _warn, _read, _owner, _entry_problem = (
    build_cache._say, build_cache._warn, build_cache._read, build_cache._owner, build_cache._entry_problem)

ISAS = ("baseline", "avx2", "avx512")  # worst first
MODULE_NAME = "overflow_fast._C"
KERNEL = build_cache.Target(MODULE_NAME, "C++ kernel", "once for this torch and CPU; a minute or more")
check_build = functools.partial(build_cache.check_build, target=KERNEL)
obtain = functools.partial(build_cache.obtain, target=KERNEL)
load_module = functools.partial(build_cache.load_module, target=KERNEL)
_library_in = functools.partial(build_cache.library_in, target=KERNEL)

# What each kernel unit is compiled for. ATen's AVX2 and AVX512 flags (cmake/Codegen.cmake), plus
# -mf16c (GCC's -mavx512f implies neither F16C nor FMA) and -mpopcnt (the AVX2 counting loops).
ISA_FLAGS = {
    "baseline": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mpopcnt"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
# The /proc/cpuinfo flags each build needs: the same instructions. Linux lists an AVX flag only
# where the OS also saves the registers (XCR0), so a listed flag is a usable one.
ISA_CPU_FLAGS = {
    "avx2": {"avx2", "fma", "f16c", "popcnt"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
}
# The per-ISA kernel unit and the macros that name at::vec's inline namespace (and ours) for it.
KERNEL_UNITS = {
    "baseline": ("kernel_default.cpp", []),
    "avx2": ("kernel_avx2.cpp", ["CPU_CAPABILITY AVX2", "CPU_CAPABILITY_AVX2"]),
    "avx512": ("kernel_avx512.cpp", ["CPU_CAPABILITY AVX512", "CPU_CAPABILITY_AVX512"]),
}
HAVE_MACRO = {"avx2": "OVERFLOW_FAST_HAVE_AVX2", "avx512": "OVERFLOW_FAST_HAVE_AVX512"}

# Intrinsics at::vec's AVX512 integer vectors use: an older GCC lacks some of them (ATen's note:
# _mm512_set_epi16 only from GCC 9) or the BW/VL/DQ flags themselves.
_AVX512_PROBE = """
#include <immintrin.h>
int main() {
  __m512i a = _mm512_set_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                               0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask64 m = _mm512_cmpeq_epi8_mask(a, _mm512_min_epi8(a, _mm512_set1_epi8(3)));
  __m512i b = _mm512_mask_set1_epi8(_mm512_setzero_si512(), m, (char)0xFF);
  __m512i c = _mm512_min_epi64(_mm512_movm_epi64(_mm512_cmpgt_epi64_mask(a, b)), b);
  return _mm512_mask2int(_mm512_cmpeq_epi32_mask(c, a)) + (int)_mm256_extract_epi16(_mm512_castsi512_si256(c), 1);
}
"""



def sources_dir():
    """The C++ sources: package data in an installed package, ``csrc/`` beside it in a checkout."""
    return build_cache.sources_dir("binding.cpp")


def installed_from_checkout():
    """Whether this package runs from a source tree (a checkout or an editable install)."""
    return sources_dir() == PACKAGE.parent / "csrc"


def cpu_flags():
    """This CPU's feature flags from /proc/cpuinfo, or None where there is no such file."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def _is_x86():
    return platform.machine().lower() in ("x86_64", "amd64")


def _aten_cap():
    """ATEN_CPU_CAPABILITY (default|avx2|avx512), torch's own cap on its kernels, caps ours too."""
    value = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    value = {"default": "baseline"}.get(value, value)
    return value if value in ISAS else None


def detect_isa():
    """The best instruction set this CPU runs, as ATen picks its own kernels."""
    best = "baseline"
    if _is_x86():
        flags = cpu_flags()
        if flags is None:  # no /proc/cpuinfo (not Linux): torch's own answer
            try:
                import torch
                capability = torch.backends.cpu.get_cpu_capability().lower()
            except Exception:
                capability = "default"
            best = capability if capability in ISAS else "baseline"
        else:
            for isa in ("avx512", "avx2"):
                if ISA_CPU_FLAGS[isa] <= flags:
                    best = isa
                    break
    cap = _aten_cap()
    if cap is not None and ISAS.index(cap) < ISAS.index(best):
        best = cap
    return best


def compiler():
    """The C++ compiler torch's build uses (``CXX``, else ``c++``)."""
    return os.environ.get("CXX") or "c++"


def compiler_builds(flags):
    """Whether the C++ compiler compiles the AVX-512 probe with these flags."""
    try:
        result = subprocess.run([compiler(), *flags, "-x", "c++", "-c", "-", "-o", os.devnull],
                                input=_AVX512_PROBE, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def isa_to_build(root, sources=None):
    """The instruction set that load() builds for (or loads a build of) in the cache folder
    ``root``: this CPU's best (detect_isa()), except AVX-512 where the compiler cannot build it and
    ``root`` holds no finished AVX-512 build: then AVX2, the next best. The build line names it."""
    isa = detect_isa()
    if isa != "avx512":
        return isa
    key = cache_key(identity(isa, sources))
    if root is not None and (Path(root) / key / DONE).is_file():
        return isa
    if shutil.which(compiler()) is None or compiler_builds(ISA_FLAGS["avx512"]):
        return isa
    return "avx2"


def identity(isa, sources=None):
    """What a build's key is made of: everything its module depends on."""
    import torch

    sources = sources_dir() if sources is None else Path(sources)
    return {
        "isa": isa,
        "torch": torch.__version__,
        "cxx11_abi": int(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "python": sys.implementation.cache_tag,
        "sources": source_hash(sources),
    }


def cache_key(ident):
    """The name of a build's directory: every part of its identity, readable."""
    return (f"{ident['isa']}-torch{ident['torch']}-cxx11abi{ident['cxx11_abi']}-{ident['python']}"
            f"-{ident['sources']}")


def translation_units(isa, sources, build_dir):
    """Every csrc/*.cpp except the per-ISA kernel units (found by glob: a file added or removed
    needs no change here), then the kernel units of this build: the baseline one, which every
    build holds, and the ISA's one through a generated wrapper that defines its CPU_CAPABILITY
    macros (torch's load() gives every unit the same flags). The units that parse the most
    headers come first, so that ninja starts them first."""
    sources = Path(sources)
    kernel_units = {unit for unit, _ in KERNEL_UNITS.values()}
    common = [p for p in sources.glob("*.cpp") if p.name not in kernel_units]
    common.sort(key=lambda p: (-p.stat().st_size, p.name))
    units = [str(p) for p in common]
    if isa != "baseline":
        unit, macros = KERNEL_UNITS[isa]
        wrapper = Path(build_dir) / f"isa_{unit}"
        text = "// generated: the kernel unit of this build, with its CPU_CAPABILITY macros\n"
        text += "".join(f"#define {macro}\n" for macro in macros) + f'#include "{unit}"\n'
        if not wrapper.is_file() or wrapper.read_text() != text:
            wrapper.write_text(text)
        units.append(str(wrapper))
    units.append(str(sources / KERNEL_UNITS["baseline"][0]))
    return units


def compile_flags(isa, ident):
    # The ISA's flags go to every unit: the module is built for this CPU only, and a unit with
    # other flags than its neighbours could hand the linker an AVX copy of a shared inline function.
    # -fopenmp: at::parallel_for runs single-threaded without it. -ffp-contract=off: complex.cpp
    # needs exact products and sums (a fused multiply-add changes the last bit).
    # -Wall, and on GCC -Wno-maybe-uninitialized: GCC 12 reports the AVX-512 intrinsics' own
    # deliberately uninitialised __Y (_mm512_undefined_epi32, GCC bug 105593) and c10::SmallVector's
    # inline buffer as "may be used uninitialized", hundreds of lines of false positives.
    # -Wno-unknown-pragmas: ATen's vec headers carry "#pragma unroll", which GCC does not know.
    # -DNDEBUG: a release build; without it pybind11 checks that the GIL is held at every reference
    # count change (PyGILState_Check: a tenth of a hook's host work).
    flags = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", *ISA_FLAGS[isa]]
    if _is_gcc():
        flags.append("-Wno-maybe-uninitialized")
    if isa in HAVE_MACRO:
        flags.append(f"-D{HAVE_MACRO[isa]}")
    # string macros: the quotes escaped for the shell that ninja runs each command in
    flags += [f'-DOVERFLOW_FAST_TORCH_VERSION=\\"{ident["torch"]}\\"',
              f'-DOVERFLOW_FAST_SOURCE_HASH=\\"{ident["sources"]}\\"']
    return flags


def _is_gcc():
    try:
        out = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in out.lower() and ("gcc" in out.lower() or "g++" in out.lower() or "free software" in out.lower())


# ---- building -----------------------------------------------------------------------------------

def _ninja_dir():
    """The folder of the ninja that pip installed with this package, when it is not on PATH (a
    virtual environment used without activating it)."""
    if shutil.which("ninja"):
        return None
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI package: its binary lives in ninja.BIN_DIR

        candidates.insert(0, Path(ninja.BIN_DIR))
    except Exception:
        pass
    for folder in candidates:
        if (folder / "ninja").is_file():
            return str(folder)
    return None


def build(isa, build_dir, sources=None, ident=None, verbose=False):
    """Compile and link the module for ``isa`` into ``build_dir``; returns the library's path.
    Raises BuildError with the compiler's first error line (the whole log in build.log there).
    ``verbose``: ninja's output (every command, every compiler message) on stdout."""
    sources = sources_dir() if sources is None else Path(sources)
    if sources is None:
        raise BuildError("the C++ sources are missing from this installation (overflow_fast/csrc)")
    if shutil.which(compiler()) is None:
        raise BuildError(f"no C++ compiler: {compiler()!r} is not on PATH (install g++, or set CXX)")
    ninja_dir = _ninja_dir()
    if ninja_dir is None and shutil.which("ninja") is None:
        raise BuildError("ninja is not installed (pip install ninja)")
    ident = identity(isa, sources) if ident is None else ident
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own baton: a build killed while holding it would make load() wait forever. The
    # caller holds our lock, so nobody else is building here.
    (build_dir / "lock").unlink(missing_ok=True)

    import warnings

    import torch.utils.cpp_extension as cpp_extension

    # Each build has its own directory and is loaded once; torch's in-process versioning would
    # rename a second build of the same name (_C_v1) and its module's init function with it.
    getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop("_C", None)
    old_path = os.environ.get("PATH", "")
    if ninja_dir is not None:
        os.environ["PATH"] = ninja_dir + os.pathsep + old_path
    units = translation_units(isa, sources, build_dir)
    try:
        with warnings.catch_warnings(record=True) as caught, _Progress(build_dir, units, quiet=verbose):
            warnings.simplefilter("always")
            try:
                library = cpp_extension.load(
                    name="_C",
                    sources=units,
                    extra_cflags=compile_flags(isa, ident),
                    extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(sources)],
                    build_directory=str(build_dir),
                    is_python_module=False,  # loaded as overflow_fast._C by load_module()
                    verbose=verbose,
                )
            except Exception as error:
                log = str(error)
                notes = "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
                (build_dir / LOG).write_text(notes + log)
                raise BuildError(first_error_line(log)) from None
    finally:
        if ninja_dir is not None:
            os.environ["PATH"] = old_path
    # load() returns the library's path from torch 2.5 on, None before: found where it was built
    return _library_in(build_dir) or Path(library)


PROGRESS_EVERY = 15.0  # seconds between two progress lines while no unit finishes
PROGRESS_LOOK = 0.5  # seconds between two looks at the build folder


class _Progress:
    """While a build runs: a line on stderr each time a unit's object file appears in the build
    folder (ninja writes it when the unit's compiler finishes), and every PROGRESS_EVERY seconds
    otherwise, with the units done and the time so far; then that the module is being linked."""

    def __init__(self, build_dir, units, quiet=False):
        import threading

        self.build_dir = Path(build_dir)
        self.objects = {Path(unit).stem + ".o" for unit in units}
        self.quiet = quiet
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="overflow_fast build progress", daemon=True)

    def __enter__(self):
        if not self.quiet:
            self.start = time.monotonic()
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if not self.quiet:
            self.stop.set()
            self.thread.join()

    def _done(self):
        try:
            return sum(1 for name in self.objects if (self.build_dir / name).is_file())
        except OSError:
            return 0

    def _run(self):
        said, said_at = 0, time.monotonic()
        while not self.stop.wait(PROGRESS_LOOK):
            done, now = self._done(), time.monotonic()
            if done == said and now - said_at < PROGRESS_EVERY:
                continue
            said, said_at = done, now
            linking = ", linking" if done == len(self.objects) else ""
            _say(f"building the C++ kernel: {done} of {len(self.objects)} units compiled{linking} "
                 f"({now - self.start:.0f} s)")


def _fix_hint():
    """How to get a kernel, for how this package was installed."""
    if installed_from_checkout():
        return ("fix what the log shows (a C++ compiler, `pip install ninja`), or build ahead of time: "
                "OVERFLOW_FAST_AOT=1 pip install --no-build-isolation -e .")
    return ("install a C++ compiler (g++) and ninja where this runs, or install a build made ahead of "
            "time on a machine that has them: OVERFLOW_FAST_AOT=1 pip install --no-build-isolation overflow_fast")


def load():
    """``(module or None, reason or None, details)``: the kernel for this process, prebuilt,
    cached or built now. Never raises for a build or load failure: the reason says what happened
    and what to do."""
    details = {"cache_root": str(cache_root())}
    if os.environ.get(WITHOUT_ENV, "") not in ("", "0"):
        return None, f"{WITHOUT_ENV}={os.environ[WITHOUT_ENV]} asks to run without it", details
    try:
        return _load(details)
    except Exception as error:  # a load error (undefined symbol), an unwritable cache...
        where = details.get("directory")
        hint = f"; delete {where} to rebuild it" if where else ""
        return None, f"the C++ kernel could not be loaded ({type(error).__name__}: {error}){hint}", details


def _load(details):
    """``load()``'s work, which may raise: the prebuilt kernel, or the cache's (``_from_cache``)."""
    sources = sources_dir()
    if sources is None:
        return None, ("the C++ sources are missing from this installation (overflow_fast/csrc): "
                      "reinstall overflow_fast"), details
    jit = os.environ.get(JIT_ENV, "1") != "0"
    isa = detect_isa()
    ident = identity(isa, sources)
    key = cache_key(ident)
    prebuilt = build_cache.prebuilt_library(PREBUILT / key, ident, target=KERNEL)
    root = rejected = None
    if prebuilt is None:
        root, rejected = cache_folder(fresh=jit)
        best, isa = isa, isa_to_build(root, sources)
        if isa != best:
            ident = identity(isa, sources)
            key = cache_key(ident)
            prebuilt = build_cache.prebuilt_library(PREBUILT / key, ident, target=KERNEL)
    details.update(isa=isa, key=key, identity=ident)
    if prebuilt is not None:
        details.update(origin="prebuilt", path=str(prebuilt), directory=str(prebuilt.parent))
        return load_module(prebuilt), None, details
    if root is None:
        return None, (f"no private folder for the C++ kernel's cache ({rejected}); point {CACHE_ENV} at a "
                      "folder of yours that nobody else can write"), details
    if rejected is not None:
        details["cache_rejected"] = rejected
        _warn(f"not using the C++ kernel's cache {cache_root()}: {rejected}, so another user could replace "
              f"what would be loaded from it; using {root} instead (fix that, or point {CACHE_ENV} "
              "at a folder of yours that nobody else can write)")
    details["cache_root"] = str(root)
    return _from_cache(root, key, ident, isa, sources, jit, details)


def _from_cache(root, key, ident, isa, sources, jit, details):
    """The kernel of ``root``/``key``: the one cached there, or (``jit``) built there now."""
    directory = root / key
    details.update(directory=str(directory))
    if not jit:
        library, problem = check_build(directory, ident)
        if library is None:
            found = "" if problem[0] == "missing" else f"; the cached one cannot be used: {problem[1]}"
            return None, (f"no prebuilt kernel matches this environment ({key}) and {JIT_ENV}=0 forbids "
                          f"building one{found}; unset {JIT_ENV}, or {_fix_hint()}"), details

    def build_here(target):
        start = time.perf_counter()
        build(isa, target, sources, ident)
        for obj in Path(target).glob("*.o"):  # never reused: a new key is a new directory
            obj.unlink()
        return {**ident, "seconds": round(time.perf_counter() - start, 1)}

    describe = f" ({isa}, torch {ident['torch']})"
    built = False
    if jit:
        try:
            found, reason, built = obtain(root, key, build_here, describe, ident)
        except OSError as error:  # a read-only home on a compute node, a full disk
            return None, (f"cannot build the C++ kernel in {root} ({type(error).__name__}: {error}); "
                          f"set {CACHE_ENV} to a writable folder, or {_fix_hint()}"), details
        if reason is not None:
            log = directory / LOG
            where = f"; full log: {log}" if log.is_file() else ""
            return None, f"the C++ kernel could not be built: {reason}{where}; {_fix_hint()}", details
    details["built_now"] = built
    # Checked once more right before loading. Between this check and dlopen the file could only
    # be swapped by someone who can write to its folders, and root/key passed the rule above:
    # only this user and root can.
    library, problem = check_build(directory, ident)
    if library is None:
        return None, f"the build in {directory} cannot be used: {problem[1]}; delete it to rebuild", details
    built_info = _read(directory / DONE)
    try:
        details["seconds"] = json.loads(built_info).get("seconds") if built_info else None
    except ValueError:
        details["seconds"] = None
    details.update(origin="cache", path=str(library))
    return load_module(library), None, details
