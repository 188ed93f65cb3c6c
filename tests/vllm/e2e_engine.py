"""One engine of the two-process test: ``python e2e_engine.py producer|consumer FOLDER``.

The producer serves two prompts and writes their ``kv_transfer_params`` (what a P/D proxy
forwards) to ``FOLDER/params.json``; the consumer serves the same prompts with those
params, loading the KV through vLLM's ExampleConnector from ``FOLDER/store``. Both audit
with dumps of every request into ``FOLDER/prefill`` and ``FOLDER/decode``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent / "examples" / "vllm_cpu")]

import harness as h  # noqa: E402

PROMPTS = {"req-a": list(range(500, 534)), "req-b": list(range(900, 934))}


def main(role: str, folder: Path) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    wrapped = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(folder / "store")},
    }
    side = "prefill" if role == "producer" else "decode"
    settings = {"output": str(folder / side), "dump_sample_rate": 1.0, "max_dump_bytes": 1 << 24}
    engine = h.make_engine(settings, wrapped, engine_id=side)
    if role == "producer":
        params = {}
        for rid, prompt in PROMPTS.items():
            engine.add(rid, prompt)
            params[rid] = engine.step()["finished"][rid]
        (folder / "params.json").write_text(json.dumps(params))
    else:
        params = json.loads((folder / "params.json").read_text())
        for rid, prompt in PROMPTS.items():
            engine.add(f"decode-{rid}", prompt, params[rid])
            engine.step()
    for worker in engine.workers:
        worker.connector.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
