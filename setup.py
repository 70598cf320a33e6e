"""Packaging of overflow_fast: the Python package plus the C++ sources (csrc/, installed as the
package data overflow_fast/csrc). Nothing is compiled here by default: the C++ kernel is built on
first use, for the torch installed then and that CPU (overflow_fast/stats/cpu_build.py), so a
plain `pip install` (build isolation on, no torch needed to build) gives a pure-Python wheel.

Ahead of time, for machines without a compiler (cluster compute nodes):

    OVERFLOW_FAST_AOT=1 pip install --no-build-isolation .          # every instruction set
    OVERFLOW_FAST_AOT=avx2,avx512 pip install --no-build-isolation .  # only these

builds the kernel now against the installed torch, once per instruction set the compiler can
build (baseline, avx2, avx512), into overflow_fast/_prebuilt/; the running process picks the one
for its CPU. Such a wheel is platform-specific and matches only that torch version.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
AOT = os.environ.get("OVERFLOW_FAST_AOT", "").strip()


def _cpu_build():
    """overflow_fast/stats/cpu_build.py, loaded alone: importing the package would import torch
    and the whole engine (and try to load a kernel)."""
    path = HERE / "overflow_fast" / "stats" / "cpu_build.py"
    spec = importlib.util.spec_from_file_location("_overflow_fast_cpu_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One instruction set per process: each build's module is loaded after linking, and two modules
# registering the same torch op library in one process is an error.
_BUILD_ONE = """
import importlib.util, shutil, sys
spec = importlib.util.spec_from_file_location("_overflow_fast_cpu_build", sys.argv[1])
cpu_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_build)
isa, scratch, dest_root = sys.argv[2], sys.argv[3], sys.argv[4]
ident = cpu_build.identity(isa)
print(f"overflow_fast: building the {isa} kernel (a minute or more)", flush=True)
library = cpu_build.build(isa, scratch, ident=ident)
dest = cpu_build.Path(dest_root) / cpu_build.cache_key(ident)
dest.mkdir(parents=True, exist_ok=True)
shutil.copy2(library, dest / library.name)
cpu_build.write_build_record(dest, dest / library.name, ident)  # its checksum, verified before each load
print(f"overflow_fast: built the {isa} kernel into {dest}")
"""


def _requested_isas(cpu_build):
    if AOT in ("1", "all"):
        isas = ["baseline"]
        if cpu_build._is_x86():
            isas.append("avx2")
            if cpu_build.compiler_builds(cpu_build.ISA_FLAGS["avx512"]):
                isas.append("avx512")
            else:
                print("overflow_fast: the compiler cannot build the AVX-512 kernel; skipping it")
        return isas
    isas = [isa.strip() for isa in AOT.split(",") if isa.strip()]
    unknown = [isa for isa in isas if isa not in cpu_build.ISAS]
    if unknown:
        raise SystemExit(f"OVERFLOW_FAST_AOT={AOT!r}: unknown instruction set(s) {unknown}; "
                         f"use 1 (all) or a list of {cpu_build.ISAS}")
    return isas


class BuildPyWithKernel(build_py):
    """build_py, then (OVERFLOW_FAST_AOT set) the C++ kernel for each requested instruction set,
    into overflow_fast/_prebuilt/ of the build (of the source tree for an editable install)."""

    def run(self):
        if not getattr(self, "editable_mode", False):
            # setuptools reuses build/lib: a source deleted from csrc/ (or a kernel prebuilt for
            # another torch) left there by an earlier build would go into this wheel, and the
            # kernel's build compiles every csrc/*.cpp it finds.
            for stale in ("csrc", "_prebuilt"):
                shutil.rmtree(Path(self.build_lib) / "overflow_fast" / stale, ignore_errors=True)
        super().run()
        if not AOT or AOT == "0":
            return
        if importlib.util.find_spec("torch") is None:
            raise SystemExit("OVERFLOW_FAST_AOT builds the C++ kernel against the installed torch: "
                             "install torch first, then pip install --no-build-isolation .")
        cpu_build = _cpu_build()
        root = Path(".") if getattr(self, "editable_mode", False) else Path(self.build_lib)
        dest_root = root / "overflow_fast" / "_prebuilt"
        for isa in _requested_isas(cpu_build):
            with tempfile.TemporaryDirectory() as scratch:
                subprocess.run([sys.executable, "-c", _BUILD_ONE, str(HERE / "overflow_fast" / "stats" / "cpu_build.py"),
                                isa, scratch, str(dest_root)], check=True)


class KernelDistribution(Distribution):
    def has_ext_modules(self):
        # a wheel holding prebuilt kernels is for this platform (and torch) only
        return bool(AOT) and AOT != "0"


setup(
    packages=find_packages(include=["overflow_fast", "overflow_fast.*"]) + ["overflow_fast.csrc"],
    package_dir={"overflow_fast.csrc": "csrc"},
    package_data={"overflow_fast": ["py.typed"], "overflow_fast.csrc": ["*.cpp", "*.h"]},
    cmdclass={"build_py": BuildPyWithKernel},
    distclass=KernelDistribution,
)
