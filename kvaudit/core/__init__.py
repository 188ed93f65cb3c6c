"""The foundations every other package stands on; they import no other kvaudit package.

``errors`` (the one-line errors and their kinds), ``validation`` (checks of parsed input),
``scheme`` (the checksum's constants and position numbering), ``dtypes`` and ``elements``
(element types and their bit patterns), ``arrays`` (numpy views of tensors), ``mapping``
(memory-mapped file rows), ``files`` (atomic outputs and input identity), ``interrupts``
(signals turned into a clean end), ``lazy`` (names imported on first use) and ``native``
(the loader of the optional C extensions).
"""
