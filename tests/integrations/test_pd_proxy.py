"""The P/D proxy of docs/vllm.md's CI recipe (examples/ci/pd_proxy.py), between two
stand-in engines on the loopback: the prefill gets ``max_tokens: 1`` and
``do_remote_decode``, the decode gets the prefill's ``kv_transfer_params``."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

PROXY = Path(__file__).resolve().parents[2] / "examples" / "ci" / "pd_proxy.py"


def load_proxy() -> Any:
    spec = importlib.util.spec_from_file_location("pd_proxy", PROXY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine(name: str, seen: list[dict[str, Any]]) -> ThreadingHTTPServer:
    """An engine answering completions with its name and the params it was given."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            answer = {"engine": name, "choices": [{"text": name}]}
            if name == "prefill":
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "kvaudit": "KVC2"}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def servers() -> Iterator[tuple[str, list, list]]:
    prefill_seen: list[dict[str, Any]] = []
    decode_seen: list[dict[str, Any]] = []
    prefill, decode = engine("prefill", prefill_seen), engine("decode", decode_seen)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (prefill, decode)]
    proxy = load_proxy().serve(*urls, 0, 10.0)
    running = [prefill, decode, proxy]
    for server in running:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", prefill_seen, decode_seen
    finally:
        for server in running:
            server.shutdown()
            server.server_close()


def test_a_completion_goes_through_prefill_then_decode(servers: tuple[str, list, list]) -> None:
    url, prefill_seen, decode_seen = servers
    with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
        assert answer.status == 200
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert json.loads(answer.read())["engine"] == "decode"
    [first] = prefill_seen
    assert (first["max_tokens"], first["prompt"]) == (1, "hello")
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    [second] = decode_seen
    assert second["max_tokens"] == 8
    assert second["kv_transfer_params"] == {"do_remote_prefill": True, "kvaudit": "KVC2"}
