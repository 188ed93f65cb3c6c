"""Builds kvaudit's optional C extensions; pyproject.toml holds the package's metadata.

Every extension is optional: where it does not build (no C compiler), the install still
succeeds and kvaudit runs the numpy code it replaces. Flags stay portable (no
``-march``): a built wheel may run on another CPU; a C file picks CPU features at load
time itself where it wants them.
"""

from setuptools import Extension, setup

C_FLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Wno-unused-parameter"]
"""Flags of every extension (gcc and clang)."""


def extension(name: str, source: str) -> Extension:
    """An optional extension module ``name`` built from one C file."""
    return Extension(name, [source], optional=True, extra_compile_args=C_FLAGS)


EXTENSIONS = [
    extension("kvaudit.kernels._native", "kvaudit/kernels/_native.c"),
]

setup(ext_modules=EXTENSIONS)
