#!/usr/bin/env bash
# The project's test job: sets up the virtual environment, then lint and the test suite.
# The README's test command and .ci/run both run exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check kvaudit tests bench examples scripts
.venv/bin/ruff format --check kvaudit tests bench examples scripts
# The install built the C extensions (setup.py); a test fails where one did not.
KVAUDIT_REQUIRE_NATIVE=1 .venv/bin/python -m pytest -q

# --- Stage: the oldest supported Triton -----------------------------------------------
# GPU machines may carry an older Triton than the newest in pyproject.toml's range: the
# kernel's interpreter tests and the ahead-of-time compile test (main variants on every
# architecture, the test matrix on sm_90) run again under the range's lower bound, in a
# virtual environment of their own.
oldest_triton=$(sed -n 's/.*"triton>=\([0-9.]*\),.*/\1/p' pyproject.toml)
python3 -m venv .venv-triton-oldest
.venv-triton-oldest/bin/pip install -q torch==2.13.0
.venv-triton-oldest/bin/pip install -q "triton==${oldest_triton}" -e '.[test]'
.venv-triton-oldest/bin/python -m pytest -q -m "not slow" \
    tests/checksum/test_kernel_backends.py tests/checksum/test_triton_kernel.py \
    tests/checksum/test_triton_engine.py tests/checksum/test_kernel_compile.py
# --- End of stage: the oldest supported Triton ----------------------------------------

# --- Stage: vLLM -----------------------------------------------------------------------
# kvaudit's vLLM connector against the real vLLM 0.33.0, in a virtual environment of its
# own: vLLM with --no-deps, then the packages its modules import (requirements/
# vllm-test.txt). vLLM 0.33.0 pins torch 2.14.0; the CPU build here is 2.13.0 (pip warns
# of the pin): vLLM's Python classes (configs, the real Scheduler and AsyncScheduler,
# block pool, connectors' scheduler sides, output types) run on it; its CUDA kernels and
# compiled extension (vllm._C) are not exercised, nor any real model forward or RDMA.
# tests/vllm is left out of the main run (pyproject.toml addopts); here an import failure
# of vLLM fails the run, never skips it.
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q torch==2.13.0
.venv-vllm/bin/pip install -q --no-deps vllm==0.33.0
.venv-vllm/bin/pip install -q -r requirements/vllm-test.txt
.venv-vllm/bin/pip install -q --no-deps -e .
.venv-vllm/bin/python -m pytest -q -o addopts="" tests/vllm
# --- End of stage: vLLM ----------------------------------------------------------------

# --- Stage: SGLang ---------------------------------------------------------------------
# The SGLang tests against the real SGLang 0.5.23, in a virtual environment of its own:
# SGLang with --no-deps, then the packages its modules import (requirements/
# sglang-test.txt), under the constraint torch==2.13.0 so that nothing replaces the CPU
# torch (SGLang 0.5.23 pins torch 2.14.1: pip warns of the pin). SGLang's Python classes
# (KV pools and allocators, runtime context, disaggregation's bootstrap and transfer
# queues, fake transfer backend, metadata buffers, plug-in hooks) run on the CPU; its CUDA
# Adler-32 checksum kernel (KvChecksumComputer.compute), MLA set_kv_buffer's Triton
# kernel, a whole Scheduler, any model forward and the Mooncake/NIXL transfer engines do
# not. The walk-through of docs/sglang.md (examples/sglang_cpu/walkthrough.py) runs among
# the tests, and test_vllm_pairing.py runs docs/vllm.md's in .venv-vllm (the vLLM stage's
# environment, built above) to compare vLLM's KV with SGLang's pools. No torchvision imports on the CPU torch: tests/sglang/conftest.py puts an
# import-only stand-in on sys.path (tests/sglang/shims/torchvision.py).
# tests/sglang is left out of the main run (pyproject.toml addopts); here an import failure
# of SGLang fails the run, never skips it.
python3 -m venv .venv-sglang
.venv-sglang/bin/pip install -q torch==2.13.0
.venv-sglang/bin/pip install -q --no-deps sglang==0.5.23
.venv-sglang/bin/pip install -q -c <(echo torch==2.13.0) -r requirements/sglang-test.txt
.venv-sglang/bin/pip install -q --no-deps -e .
.venv-sglang/bin/python -m pytest -q -o addopts="" tests/sglang
# --- End of stage: SGLang --------------------------------------------------------------
