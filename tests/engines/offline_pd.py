"""vLLM's offline P/D pattern in whole engines: ``python offline_pd.py producer|consumer
MODEL OUT``. Two ``LLM`` instances, one after the other, share ExampleConnector's folder
(``OUT/store``); kvaudit's connector on both writes ``OUT/prefill`` and ``OUT/decode``.
No proxy carries ``kv_transfer_params``, so each engine names a prompt's request its own
way, and ``kvaudit diff`` pairs them by their prompts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPTS = [" ".join(f"w{(11 * i + j) % 1000}" for j in range(64 + 32 * i)) for i in range(3)]


def main(role: str, model: str, out: Path) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    side = "prefill" if role == "producer" else "decode"
    config = KVTransferConfig(
        kv_connector="KVAuditConnector",
        kv_connector_module_path="kvaudit.integrations.vllm",
        kv_role=f"kv_{role}",
        kv_connector_extra_config={
            "kvaudit": {"output": str(out / side), "dump_sample_rate": 1.0,
                        "max_dump_bytes": 1 << 28},
            "wrapped": {"kv_connector": "ExampleConnector",
                        "kv_connector_extra_config": {"shared_storage_path": str(out / "store")}},
        },
    )  # fmt: skip
    llm = LLM(model=model, enforce_eager=True, dtype="float32", block_size=32,
              max_model_len=512, kv_transfer_config=config)  # fmt: skip
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1 if role ==
                                                   "producer" else 6))  # fmt: skip
    (out / f"{side}.json").write_text(json.dumps([o.outputs[0].text for o in outputs]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
