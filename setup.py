"""Build of the optional C++ CPU kernel (csrc/) through torch's BuildExtension and ninja.

Set OVERFLOW_FAST_NO_EXTENSION=1 to install the pure-Python package only.

The kernel is compiled up to three times, into the same extension: once for a safe baseline (no
ISA flags) and, on x86-64, once with AVX2 flags and once with AVX-512 flags (when the compiler can
build them); the binding picks one at run time, so the build works, and the module runs, on any
x86-64 CPU.
"""

import importlib.util
import os
import platform
import subprocess
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

# ATen's flags for its AVX512 build (cmake/Codegen.cmake), plus -mf16c as in its AVX2 build
# (GCC's -mavx512f does not imply F16C or FMA).
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]

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


def compiler_builds(flags):
    """Whether the C++ compiler that the extension will use compiles the probe with these flags."""
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([compiler, *flags, "-x", "c++", "-c", "-", "-o", os.devnull],
                                input=_AVX512_PROBE, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


ext_modules = []
cmdclass = {}

if os.environ.get("OVERFLOW_FAST_NO_EXTENSION") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildExtensionPerFileFlags(BuildExtension):
        """BuildExtension gives every source the same flags; this compiles the sources listed in
        an extension's ``per_file_flags`` ({source: extra flags}) on their own, with their flags,
        and links the objects in after the other sources. The AVX2 and AVX-512 objects go last on
        the link line so that, for any inline function emitted by several objects, the linker keeps
        the baseline copy."""

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
    avx512 = x86 and os.environ.get("OVERFLOW_FAST_NO_AVX512") != "1" and compiler_builds(AVX512_FLAGS)
    if x86 and not avx512:
        print("overflow_fast: building without the AVX-512 kernel (the compiler cannot build it, "
              "or OVERFLOW_FAST_NO_AVX512=1)")
    # -fopenmp in both compile and link: without it at::parallel_for runs single-threaded.
    # -Wno-unknown-pragmas: ATen's vec headers carry "#pragma unroll", which GCC does not know.
    # -ffp-contract=off: the complex magnitude (complex.cpp) relies on exact products and sums;
    # a multiply-add fused by the compiler (the default where FMA is baseline, e.g. aarch64)
    # would change its last bit.
    common = ["-O3", "-fopenmp", "-Wno-unknown-pragmas", "-ffp-contract=off"]
    extension = CppExtension(
        name="overflow_fast._C",
        sources=[f"{CSRC}/kernel_default.cpp", f"{CSRC}/complex.cpp", f"{CSRC}/table.cpp",
                 f"{CSRC}/hooks.cpp"],
        depends=[f"{CSRC}/stats.h", f"{CSRC}/kernel.h", f"{CSRC}/prefetch.h"],
        extra_compile_args={"cxx": common},
        extra_link_args=["-fopenmp"],
    )
    # Only the binding sees the build's identity, so that editing a kernel rebuilds just the
    # objects that changed plus the binding.
    extension.per_file_flags = {
        f"{CSRC}/binding.cpp": [
            f'-DOVERFLOW_FAST_TORCH_VERSION="{torch.__version__}"',
            f'-DOVERFLOW_FAST_SOURCE_HASH="{source_hash(HERE / CSRC)}"',
        ] + (["-DOVERFLOW_FAST_HAVE_AVX2"] if x86 else [])
          + (["-DOVERFLOW_FAST_HAVE_AVX512"] if avx512 else []),
    }
    if x86:
        # CPU_CAPABILITY names the inline namespace of at::vec and of our kernel, so the two
        # builds of the same templates never share a symbol.
        extension.per_file_flags[f"{CSRC}/kernel_avx2.cpp"] = [
            "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c", "-mpopcnt",
        ]
    if avx512:
        extension.per_file_flags[f"{CSRC}/kernel_avx512.cpp"] = [
            "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", *AVX512_FLAGS,
        ]
    ext_modules = [extension]
    cmdclass = {"build_ext": BuildExtensionPerFileFlags.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
