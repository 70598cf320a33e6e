"""The fast paths of ``overflow-fast diff`` in C (csrc/logscan.c): ``native()`` is the module, or
None where it cannot be had. Each function has its Python twin, its specification: ``scan`` reads
a chunk of a log's lines into entries (``entries.scan_python``: a regular expression, the same
lines to the same Entry, about five times slower), ``run_length`` finds how far two logs' records
pair one with the other and ``divergence`` compares a pair (``diff._run_length``, ``diff.divergence``).

Plain C on the Python API, no torch: built on first use with the C compiler (``CC``, else ``cc``)
for this Python, in a second or two, into the cache the C++ kernel uses, under the same rules
(``build_cache``: one build at a time, loaded only from folders nobody else can write, checked
against its checksum); or prebuilt (``OVERFLOW_FAST_AOT``). ``OVERFLOW_FAST_WITHOUT_EXTENSION`` and
``OVERFLOW_FAST_JIT=0`` mean here what they mean for the kernel.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .. import build_cache

SOURCE = "logscan.c"
LOGSCAN = build_cache.Target("overflow_fast._logscan", "C fast path of overflow-fast diff", "once for this Python; seconds")

_loaded = None  # (module or None, why not), once per process


def sources_dir():
    """The folder holding csrc/logscan.c: package data when installed, ``csrc/`` in a checkout."""
    return build_cache.sources_dir(SOURCE)


def identity(sources):
    """What a build depends on: this Python (its ABI), the machine, the source."""
    return {
        "module": LOGSCAN.module,
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "sources": hashlib.sha256((Path(sources) / SOURCE).read_bytes()).hexdigest()[:16],
    }


def cache_key(ident):
    return f"logscan-{ident['python']}-{ident['machine']}-{ident['sources']}"


def compiler():
    return os.environ.get("CC") or "cc"


def build(directory, sources):
    """Compile csrc/logscan.c into ``directory``; BuildError with the compiler's first error."""
    if shutil.which(compiler()) is None:
        raise build_cache.BuildError(f"no C compiler: {compiler()!r} is not on PATH (install gcc, or set CC)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise build_cache.BuildError(f"Python's headers are missing ({include}/Python.h): install python3-dev")
    library = Path(directory) / build_cache.library_names(LOGSCAN)[0]
    command = [compiler(), "-O2", "-fPIC", "-shared", "-Wall", f"-I{include}", str(Path(sources) / SOURCE),
               "-o", str(library)]
    if sys.platform == "darwin":
        command[1:1] = ["-undefined", "dynamic_lookup"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        raise build_cache.BuildError(f"{compiler()} could not run: {error}") from None
    if result.returncode != 0:
        output = result.stdout + result.stderr
        (Path(directory) / build_cache.LOG).write_text(" ".join(command) + "\n" + output)
        raise build_cache.BuildError(build_cache.first_error_line(output))
    return library


def build_prebuilt(root):
    """Build it ahead of time into ``root`` (the package's ``_prebuilt``: setup.py with
    ``OVERFLOW_FAST_AOT``), where ``load()`` looks first; returns the library's path."""
    sources = sources_dir()
    ident = identity(sources)
    directory = Path(root) / cache_key(ident)
    directory.mkdir(parents=True, exist_ok=True)
    library = build(directory, sources)
    build_cache.write_build_record(directory, library, ident)
    return library


def load():
    """``(module or None, why not or None)``: prebuilt, cached, or built now. Never raises."""
    if os.environ.get(build_cache.WITHOUT_ENV, "") not in ("", "0"):
        return None, f"{build_cache.WITHOUT_ENV}={os.environ[build_cache.WITHOUT_ENV]} asks to run without it"
    try:
        sources = sources_dir()
        if sources is None:
            return None, f"csrc/{SOURCE} is missing from this installation"
        ident = identity(sources)
        key = cache_key(ident)
        library = build_cache.prebuilt_library(build_cache.PREBUILT / key, ident, target=LOGSCAN)
        if library is None:
            jit = os.environ.get(build_cache.JIT_ENV, "1") != "0"
            root, rejected = build_cache.cache_folder(fresh=jit)
            if root is None:
                return None, f"no private cache folder ({rejected})"
            if jit:
                def build_here(directory):
                    build(directory, sources)
                    return ident  # what its record says it was built for

                _, reason, _ = build_cache.obtain(root, key, build_here, ident=ident, target=LOGSCAN)
                if reason is not None:
                    return None, f"it could not be built: {reason}"
            library, problem = build_cache.check_build(root / key, ident, target=LOGSCAN)
            if library is None:
                if not jit and problem[0] == "missing":
                    return None, f"none prebuilt for this Python, and {build_cache.JIT_ENV}=0 forbids building one"
                return None, problem[1]
        return build_cache.load_module(library, target=LOGSCAN), None
    except Exception as error:  # an unwritable cache, a load error: the regular expression still reads
        return None, f"{type(error).__name__}: {error}"


def native():
    """The module built from csrc/logscan.c, or None (``status()`` says why)."""
    global _loaded
    if _loaded is None:
        _loaded = load()
    return _loaded[0]


def status():
    """"C (<file>)" or "Python (<why not C>)": how this process reads logs."""
    module = native()
    return f"C ({module.__file__})" if module is not None else f"Python ({_loaded[1]})"
