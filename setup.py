"""Build of the optional C++ CPU kernel (csrc/) through torch's BuildExtension and ninja.

Set OVERFLOW_FAST_NO_EXTENSION=1 to install the pure-Python package only.
"""

import os

from setuptools import setup

ext_modules = []
cmdclass = {}

if os.environ.get("OVERFLOW_FAST_NO_EXTENSION") != "1":
    from torch.utils.cpp_extension import BuildExtension

    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
