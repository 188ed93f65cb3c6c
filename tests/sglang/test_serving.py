"""kvaudit's live agent inside SGLang's scheduler loop (``kvaudit.integrations.sglang.
serving``, ``KVAUDIT_SGLANG_LIVE``): SGLang's ``load_plugins()`` hooks
``Scheduler.ingest_requests`` from kvaudit's installed entry point; the hook starts an
agent on the scheduler's real pool at its first call and answers clients at each call, so
that ``kvaudit diff live:PREFILL live:DECODE`` compares a prefill's requests being sent
with a decode's committed ones.

The pools, allocators and rows are SGLang's own (examples/sglang_cpu/pd_world.py); the
scheduler is a plain object holding what the hook reads (a whole ``Scheduler`` does not
run on the CPU), and the test calls the hook as SGLang's event loop does, once per
iteration, while ``kvaudit diff`` runs in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from pd_world import CHANGED, REQUESTS, Decode, World

from kvaudit.integrations.sglang import serving

ROOT = Path(__file__).resolve().parents[2]
SERVED = ("req-ok", "req-bad", "req-prefix")


def _scheduler(world: World, group, mode: str, reqs: list) -> SimpleNamespace:
    queues = (
        {"disagg_prefill_inflight_queue": reqs, "waiting_queue": []}
        if mode == "prefill"
        else {"waiting_queue": reqs[:1], "running_batch": SimpleNamespace(reqs=reqs[1:])}
    )
    return SimpleNamespace(
        token_to_kv_pool_allocator=world.allocator,
        req_to_token_pool=world.req_to_token,
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 4),
        attn_tp_cpu_group=group,
        disaggregation_mode=SimpleNamespace(value=mode),
        **queues,
    )


def _reqs(world: World) -> list:
    return [
        SimpleNamespace(
            rid=rid,
            kv=SimpleNamespace(req_pool_idx=world.rows[rid]),
            origin_input_ids=list(range(REQUESTS[rid][0])),
        )
        for rid in SERVED
    ]


def test_the_scheduler_loop_serves_its_pool_to_live_clients(
    tp1_decode, monkeypatch, tmp_path
) -> None:
    gloo_group = tp1_decode
    root = tmp_path / "run"
    prefill_world = World(0, 1, list(REQUESTS), junk=2)
    decode = Decode(gloo_group, monkeypatch.setattr)  # req-bad's cell changed
    schedulers = {
        "prefill": _scheduler(prefill_world, gloo_group, "prefill", _reqs(prefill_world)),
        "decode": _scheduler(decode.world, gloo_group, "decode", _reqs(decode.world)),
    }
    intake = []
    for name, scheduler in schedulers.items():
        monkeypatch.setenv("KVAUDIT_SGLANG_LIVE", str(root / name))
        got = serving.around_ingest_requests(lambda self: intake.append(1) or ["r"], scheduler)
        assert got == ["r"]  # SGLang's own intake ran, its result returned
        agent = serving.agent_of(scheduler)
        assert agent is not None and Path(agent.path) == root / name / "pp0-tp0.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "kvaudit", "diff", f"live:{root / 'prefill'}",
               f"live:{root / 'decode'}", "--format", "json"]  # fmt: skip
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 300
    while client.poll() is None and time.monotonic() < deadline:
        for scheduler in schedulers.values():  # one event-loop iteration each
            serving.around_ingest_requests(lambda self: [], scheduler)
        time.sleep(0.01)
    out, err = client.communicate(timeout=10)
    for scheduler in schedulers.values():
        agent = serving.agent_of(scheduler)
        assert agent is not None
        agent.close()
    assert client.returncode == 1, err.decode()[-2000:]
    report = json.loads(out)
    assert sorted(report["requests"]) == sorted(SERVED)
    rid, layer, head, token = CHANGED
    groups = {r: report["requests"][r]["groups"]["0"] for r in SERVED}
    assert {r: g["mismatched_positions"] for r, g in groups.items()} == {
        "req-ok": [],
        "req-bad": [token // 16],
        "req-prefix": [],
    }
    (entry,) = groups[rid]["located"]
    assert (entry["layer"], entry["head"], entry["tokens"]) == (
        f"model.layers.{layer}.self_attn.attn",
        head,
        [token],
    )


def test_a_failing_agent_never_stops_the_scheduler(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("KVAUDIT_SGLANG_LIVE", str(tmp_path / "engine"))
    broken = SimpleNamespace()  # no pools: the agent cannot start
    with caplog.at_level("ERROR"):
        for _ in range(3):
            assert serving.around_ingest_requests(lambda self: ["r"], broken) == ["r"]
    assert [r.message for r in caplog.records].count(
        "kvaudit: the live agent failed; the engine goes on without it"
    ) == 1
