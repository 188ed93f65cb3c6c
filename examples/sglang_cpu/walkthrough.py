"""kvaudit in SGLang on the CPU, in a minute: a TP=2 prefill, a TP=1 decode, a planted fault
caught inline where SGLang's own checksum admits the transfer unverified, then located.

    python examples/sglang_cpu/walkthrough.py OUT     # in the SGLang environment (docs/sglang.md)

The prefill is two processes on one gloo group, each with its own real SGLang pool; every
request's last chunk goes through SGLang's real ``send_kv_chunk`` with kvaudit's hooks
installed through SGLang's ``HookRegistry``, as ``KVAUDIT_SGLANG_INLINE=1`` installs them.
The decode (this process) holds the requests' KV in other pages of its own pool, with one
element of ``req-bad`` changed (layer 1, head 2, token 33: the broken transfer), and runs
SGLang's real ``_commit_transfer_to_req`` and ``_verify_kv_checksums``. Both engines write
kvaudit's output folder (``KVAUDIT_SGLANG_OUTPUT``); the prefill dumps what it sends
(rotating dumps), the decode dumps the request that failed. ``kvaudit diff`` of the two
folders names the differing block, of the two dumps the layer, head and token. Exits 0
when all of that happened as described.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("torchvision") is None:  # SGLang's pools import it at load
    sys.path.insert(0, str(ROOT / "tests" / "sglang" / "shims"))


def kvaudit(*args: object, show: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the ``kvaudit`` command (printed with its output when ``show``)."""
    command = [sys.executable, "-m", "kvaudit", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if show:
        print("$ kvaudit " + " ".join(map(str, args)), flush=True)
        print(done.stdout + done.stderr, flush=True)
    return done


def main(out: Path) -> int:
    import torch.distributed as dist
    from pd_world import CHANGED, Decode, file_init, register_inline, run_prefill
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_context, get_parallel

    from kvaudit.integrations.sglang import inline

    logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
    out = out.absolute()  # the engines' folders and gloo's rendezvous files, from any cwd
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run"
    run.mkdir(exist_ok=True)
    print("prefill: TP=2, two processes on gloo, kvaudit's hooks on send_kv_chunk", flush=True)
    senders = run_prefill(run, output=str(out / "prefill"))

    print("decode: TP=1, req-bad's KV changed at layer 1, head 2, token 33", flush=True)
    os.environ.update(
        KVAUDIT_SGLANG_OUTPUT=str(out / "decode"), KVAUDIT_SGLANG_MAX_DUMP_BYTES=str(10**8)
    )
    os.environ.pop("SGLANG_IS_IN_CI", None)  # SGLang raises on a mismatch in its own CI
    dist.init_process_group("gloo", init_method=file_init(run / "decode"), rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    get_context().override_server_args(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    ).install()
    parallel = {"tp_rank": 0, "pp_rank": 0, "attn_tp_rank": 0,
                "attn_tp_group": SimpleNamespace(cpu_group=group)}  # fmt: skip
    with get_parallel().override(**parallel):
        register_inline()
        HookRegistry.apply_hooks()
        decode = Decode(group, setattr)
        sglang_checks = decode.queue._kv_checksum_comparable(senders[0]["signature"])
        print(f"SGLang's own check compares this transfer: {sglang_checks}", flush=True)
        reqs = [
            decode.receive(rid, senders, index)
            for index, rid in enumerate(("req-ok", "req-prefix", "req-bad"), start=2)
        ]
        kept = [req.rid for req in decode.verify(reqs)]
    stats = inline.inline_stats()
    print(f"kept in the batch: {kept}; aborted through SGLang: {decode.aborts}")
    print(f"kvaudit: {stats['verified']} verified, {stats['mismatched']} mismatched")

    folders = kvaudit("diff", out / "prefill", out / "decode", "--request", "req-bad")
    rid = CHANGED[0]
    dumps = kvaudit("diff", out / "prefill" / "dumps" / rid, out / "decode" / "dumps" / rid)
    located = kvaudit(
        "diff", out / "prefill" / "dumps" / rid, out / "decode" / "dumps" / rid,
        "--format", "json", show=False,
    )  # fmt: skip
    entry = json.loads(located.stdout)["requests"][rid]["groups"]["0"]["located"][0]
    expected = (
        sglang_checks is False
        and kept == ["req-ok", "req-prefix"]
        and decode.aborts == [rid]
        and (stats["verified"], stats["mismatched"]) == (2, 1)
        and folders.returncode == 1
        and dumps.returncode == 1
        and (entry["layer"], entry["head"], entry["tokens"])
        == (f"model.layers.{CHANGED[1]}.self_attn.attn", CHANGED[2], [CHANGED[3]])
    )
    print("walk-through done: caught inline and located" if expected else "walk-through FAILED")
    return 0 if expected else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python examples/sglang_cpu/walkthrough.py OUT", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
