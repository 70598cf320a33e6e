"""Build of the optional C++ CPU kernel (csrc/) through torch's BuildExtension and ninja.

Set OVERFLOW_FAST_NO_EXTENSION=1 to install the pure-Python package only.

The kernel is compiled twice, into the same extension: once for a safe baseline (no ISA flags) and,
on x86-64, once more with AVX2 flags; the binding picks one at run time, so the build works, and
the module runs, on any x86-64 CPU.
"""

import importlib.util
import os
import platform
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
CSRC = "csrc"


def _load_source_hash():
    """overflow_fast/stats/source_hash.py, loaded alone: importing the package would import torch
    and the whole engine."""
    path = HERE / "overflow_fast" / "stats" / "source_hash.py"
    spec = importlib.util.spec_from_file_location("_overflow_fast_source_hash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash


source_hash = _load_source_hash()


ext_modules = []
cmdclass = {}

if os.environ.get("OVERFLOW_FAST_NO_EXTENSION") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildExtensionPerFileFlags(BuildExtension):
        """BuildExtension gives every source the same flags; this compiles the sources listed in
        an extension's ``per_file_flags`` ({source: extra flags}) on their own, with their flags,
        and links the objects in after the other sources. The AVX2 object goes last on the link
        line so that, for any inline function emitted by several objects, the linker keeps the
        baseline copy."""

        def build_extension(self, ext):
            objects = []
            for source, flags in getattr(ext, "per_file_flags", {}).items():
                cxx = list(ext.extra_compile_args["cxx"]) + list(flags)
                objects += self.compiler.compile(
                    [source],
                    output_dir=self.build_temp,
                    macros=ext.define_macros,
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs={"cxx": cxx},
                    depends=ext.depends,
                )
            ext.extra_objects = list(getattr(ext, "extra_objects", []) or []) + objects
            super().build_extension(ext)

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    # -fopenmp in both compile and link: without it at::parallel_for runs single-threaded.
    # -Wno-unknown-pragmas: ATen's vec headers carry "#pragma unroll", which GCC does not know.
    # -ffp-contract=off: the complex magnitude (complex.cpp) relies on exact products and sums;
    # a multiply-add fused by the compiler (the default where FMA is baseline, e.g. aarch64)
    # would change its last bit.
    common = ["-O3", "-fopenmp", "-Wno-unknown-pragmas", "-ffp-contract=off"]
    extension = CppExtension(
        name="overflow_fast._C",
        sources=[f"{CSRC}/kernel_default.cpp", f"{CSRC}/complex.cpp"],
        depends=[f"{CSRC}/stats.h", f"{CSRC}/kernel.h"],
        extra_compile_args={"cxx": common},
        extra_link_args=["-fopenmp"],
    )
    # Only the binding sees the build's identity, so that editing a kernel rebuilds just the
    # objects that changed plus the binding.
    extension.per_file_flags = {
        f"{CSRC}/binding.cpp": [
            f'-DOVERFLOW_FAST_TORCH_VERSION="{torch.__version__}"',
            f'-DOVERFLOW_FAST_SOURCE_HASH="{source_hash(HERE / CSRC)}"',
        ] + (["-DOVERFLOW_FAST_HAVE_AVX2"] if x86 else []),
    }
    if x86:
        # CPU_CAPABILITY names the inline namespace of at::vec and of our kernel, so the two
        # builds of the same templates never share a symbol.
        extension.per_file_flags[f"{CSRC}/kernel_avx2.cpp"] = [
            "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c",
        ]
    ext_modules = [extension]
    cmdclass = {"build_ext": BuildExtensionPerFileFlags.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
