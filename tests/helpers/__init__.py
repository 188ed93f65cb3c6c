"""What the test modules share: the plain numpy reference of the spec (``reference``),
engines' KV built and laid out (``kvbuild``), dump sets (``dumped_sets``, ``valued_sets``),
engine runs (``engine_runs``), a toy engine serving a live agent (``live_engine``), the
kernel compiled ahead of time (``triton_compile``, ``kernel_variants``, ``kernel_cases``),
the fuzz targets (``fuzz_inputs``) and the rest of the tests' tooling."""
