"""A minimal prefill/decode proxy for vLLM's OpenAI server, for kvaudit's CI recipe.

    python examples/ci/pd_proxy.py --prefill http://localhost:8100 \
        --decode http://localhost:8200 --port 8000

``POST /v1/completions`` goes to the prefill engine with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` it answers
with (NIXL's remote blocks, kvaudit's checksums) go with the original request to the
decode engine, whose answer is returned. ``GET /health`` is 200 when both engines answer
theirs. The standard library only; one request at a time per connection.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON answer."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def completion(prefill: str, decode: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One P/D completion: prefill for its KV, then decode with its transfer params."""
    remote = {"do_remote_decode": True, "do_remote_prefill": False}
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": remote}
    params = post(f"{prefill}/v1/completions", first, timeout).get("kv_transfer_params")
    return post(f"{decode}/v1/completions", {**body, "kv_transfer_params": params}, timeout)


class _Server(ThreadingHTTPServer):
    """The proxy's server: a listen queue for many clients at once (the standard
    library's default of 5 resets connections that arrive together), threads that do
    not keep the process alive."""

    request_queue_size = 128
    daemon_threads = True


def serve(prefill: str, decode: str, port: int, timeout: float) -> ThreadingHTTPServer:
    """The proxy's server on ``127.0.0.1:port`` (not yet serving)."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._answer(404, {"error": "not found"})
            elif healthy(prefill) and healthy(decode):
                self._answer(200, {"status": "ok"})
            else:
                self._answer(503, {"error": "an engine is not ready"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._answer(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            try:
                self._answer(200, completion(prefill, decode, body, timeout))
            except (urllib.error.URLError, OSError, ValueError) as error:
                self._answer(502, {"error": f"{type(error).__name__}: {error}"})

        def log_message(self, format: str, *args: Any) -> None:
            return

    return _Server(("127.0.0.1", port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    parser.add_argument("--decode", required=True, help="the decode engine's base URL")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    serve(
        args.prefill.rstrip("/"), args.decode.rstrip("/"), args.port, args.timeout
    ).serve_forever()


if __name__ == "__main__":
    main()
