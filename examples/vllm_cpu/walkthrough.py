"""kvaudit in vLLM on the CPU, in a few minutes: a broken transfer caught inline and located.

    python examples/vllm_cpu/walkthrough.py OUT      # in the vLLM environment (docs/vllm.md)

Two engines run vLLM 0.33.0's own scheduler (``cpu_engine.py``; the model is a stand-in
whose forward writes known KV) with kvaudit's connector around vLLM's ExampleConnector,
configured as in production: ``"kv_connector": "KVAuditConnector",
"kv_connector_module_path": "kvaudit.integrations.vllm"``, ``"wrapped":
{"kv_connector": "ExampleConnector", ...}``. The prefill engine
computes ``req-7`` (80 tokens, five 16-token blocks) and stores its KV; one bit of the
stored KV is flipped (the broken transfer); the decode engine, which already holds the
request's first 48 tokens in its prefix cache, loads the rest. kvaudit compares the
loaded block with the producer's checksums, logs the mismatch (and what it did not
compare), dumps both sides; ``kvaudit diff`` of the dumps locates the layer, head, token
and byte. Exits 0 when all of that happened as described.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import cpu_engine as engine

PROMPT = list(range(100, 180))
# The stored byte to flip: token 50 (block 3), head 1 of layer 1. ExampleConnector stores
# each layer's loaded tokens as [tokens, heads, 2 * head_size] bf16 (32-byte cells).
LAYER, TOKEN, HEAD, CELL_BYTES = 1, 50, 1, 2 * 2 * engine.HEAD_SIZE


def kvaudit_engine(out: Path, side: str, role: str) -> engine.Engine:
    """One engine, kvaudit around ExampleConnector, writing to ``out / side``."""
    settings = {"output": str(out / side), "dump_sample_rate": 1.0, "max_dump_bytes": 1 << 26}
    example = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(out / "store")},
    }
    transfer = engine.transfer_config(settings, example, role, engine_id=side)
    return engine.make_engine(out, transfer)


def flip_stored_bit(store: Path) -> Path:
    """Flip one bit of the stored KV of token TOKEN, head HEAD, layer LAYER."""
    [folder] = [p for p in store.iterdir() if p.is_dir()]
    target = folder / f"{engine.LAYER.format(LAYER)}.safetensors"
    data = bytearray(target.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + (TOKEN * engine.HEADS + HEAD) * CELL_BYTES + 2] ^= 0x08
    target.write_bytes(bytes(data))
    return target


def kvaudit(*args: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvaudit", *map(str, args)]
    print("$ kvaudit " + " ".join(map(str, args)), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    print(done.stdout + done.stderr, flush=True)
    return done


def main(out: Path) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("kvaudit").setLevel(logging.INFO)
    out.mkdir(parents=True, exist_ok=True)

    print("== prefill: req-7, 80 tokens", flush=True)
    prefill = kvaudit_engine(out, "prefill", "kv_producer")
    prefill.add("req-7", PROMPT)
    prefill.run()
    params = prefill.params("req-7")
    (out / "params.json").write_text(json.dumps(params))
    print(f"kv_transfer_params handed to the proxy: {sorted(params)}", flush=True)

    print("== the transfer breaks: one bit of the stored KV flipped", flush=True)
    print(f"flipped in {flip_stored_bit(out / 'store')}", flush=True)

    print("== decode: holds the first 48 tokens already, loads the rest", flush=True)
    decode = kvaudit_engine(out, "decode", "kv_consumer")
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    decode.add("req-7-decode", PROMPT, params, max_tokens=4)
    decode.run()
    counters = decode.connector_counters()
    print(f"kvaudit counters: {json.dumps(counters)}", flush=True)

    print("== locate the damage from the two dumps", flush=True)
    dumps = [out / side / "dumps" / "req-7" for side in ("prefill", "decode")]
    located = kvaudit("diff", *dumps, "--allow-missing")
    print("== compare the two engines' records", flush=True)
    records = kvaudit("diff", out / "prefill", out / "decode", "--allow-missing")
    caught = counters.get("mismatched_blocks") == 1 and counters.get("local_blocks") == 3
    ok = caught and located.returncode == 1 and records.returncode == 1
    print("walk-through " + ("done: caught inline and located" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2].strip())
    sys.exit(main(Path(sys.argv[1])))
