"""kvaudit's C sources, each an optional CPython extension built by ``setup.py``.

``_row_sums.c`` (the checksum's per-row sums on the CPU, which the numpy backend calls),
``_element_errors.c`` with its headers (``diff --numeric``'s errors in one pass, from
buffers or from the dumps' mappings) and ``_value_reads.c`` (a dump's rows read into a
side's buffers). ``kvaudit.core.native`` loads them; where one did not build, the numpy
code it replaces runs, with the same results.
"""
