"""Builds kvaudit's optional C extensions; pyproject.toml holds the package's metadata.

Every extension is optional: where it does not build (no C compiler), the install still
succeeds and kvaudit runs the numpy code it replaces. Flags stay portable (no
``-march``): a built wheel may run on another CPU; a C file picks CPU features at load
time itself where it wants them.
"""

from setuptools import Extension, setup

C_FLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Wno-unused-parameter"]
"""Flags of every extension (gcc and clang)."""


def extension(
    name: str, source: str, depends: tuple[str, ...] = (), flags: tuple[str, ...] = ()
) -> Extension:
    """An optional extension module ``name`` built from one C file (and the headers it
    includes, ``depends``), with ``flags`` beside ``C_FLAGS``."""
    return Extension(
        name,
        [source],
        depends=list(depends),
        optional=True,
        extra_compile_args=[*C_FLAGS, *flags],
    )


EXTENSIONS = [
    extension(
        "kvaudit._native._row_sums",
        "kvaudit/_native/_row_sums.c",
        depends=("kvaudit/_native/_inline.h", "kvaudit/_native/_piece_views.h"),
    ),
    extension(
        "kvaudit._native._element_errors",
        "kvaudit/_native/_element_errors.c",
        depends=(
            "kvaudit/_native/_element_errors_copies.h",
            "kvaudit/_native/_element_errors_f64.h",
            "kvaudit/_native/_element_errors_fused.h",
            "kvaudit/_native/_element_errors_row.h",
            "kvaudit/_native/_element_values.h",
            "kvaudit/_native/_inline.h",
            "kvaudit/_native/_mapped_rows.h",
        ),
        # No fused multiply-adds: the tolerance test rounds as numpy's does (bit for bit).
        flags=("-ffp-contract=off",),
    ),
    extension("kvaudit._native._value_reads", "kvaudit/_native/_value_reads.c"),
    extension(
        "kvaudit._native._strong_sums",
        "kvaudit/_native/_strong_sums.c",
        depends=("kvaudit/_native/_piece_views.h",),
    ),
]

setup(ext_modules=EXTENSIONS)
