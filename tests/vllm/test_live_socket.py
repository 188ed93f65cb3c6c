"""The connector's live agent (``live_socket``): each worker serves its cache on
``ppP-tpT.sock`` with the block tables the scheduler sent, answered at the worker's
step boundary, and the command line reads the engine's checksums from it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import harness as h
from click.testing import CliRunner, Result
from expected import totals

from kvaudit.cli import main

PROMPT = list(range(500, 534))  # 34 tokens


def test_live_socket_serves_every_worker(tmp_path: Path) -> None:
    folder = tempfile.mkdtemp(prefix="kvv-", dir="/tmp")
    wrapped = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")},
    }
    engine = h.make_engine({"live_socket": folder}, wrapped, engine_id="P", tp_size=2)
    try:
        engine.add("req-a", PROMPT)
        engine.step()
        assert sorted(os.listdir(folder)) == ["pp0-tp0.sock", "pp0-tp1.sock"]
        got: dict[str, Result] = {}
        args = ["checksum", f"live:{folder}", "--request", "req-a", "--format", "json"]
        asking = threading.Thread(target=lambda: got.update(out=CliRunner().invoke(main, args)))
        asking.start()
        deadline = time.monotonic() + 60
        while asking.is_alive() and time.monotonic() < deadline:
            for worker in engine.workers:  # the engine between steps: its step boundary
                worker.connector.worker_audit.agent.poll()
            time.sleep(0.01)
        asking.join()
        result = got["out"]
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["complete"] is True
        want = totals(PROMPT, 34, layers=2, heads=4, head_size=8, block_size=16)
        assert [int(v, 16) for v in record["requests"]["req-a"]["groups"]["0"]["totals"]] == want
    finally:
        for worker in engine.workers:
            worker.connector.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    assert not os.path.exists(os.path.join(folder, "pp0-tp0.sock"))
