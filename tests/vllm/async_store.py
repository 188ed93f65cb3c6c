"""Connectors of the tests' own, loaded through vLLM's factory by module path.

``AsyncStoreConnector`` loads asynchronously, as NIXL does: the consumer's load runs
between steps and is reported finished by ``get_transfer_results`` ``LATENCY`` steps after
it started (the request waits in ``WAITING_FOR_REMOTE_KVS`` meanwhile). KV moves through
an in-process store keyed by the prompt's tokens; the load covers the tokens past the
consumer's local prefix-cache hit, up to the whole prompt (vLLM recomputes the last one).
``DAMAGE`` flips one bit of a layer's loaded copy of one block position.

``SyncStoreConnector`` is the same store loaded synchronously (in ``start_load_kv``,
before the forward), like ExampleConnector but unknown to kvaudit.

``NixlWire`` is the worker side behind vLLM's real ``NixlConnector`` scheduler side,
where NIXL's transport cannot run (no RDMA here): it reads NIXL's own metadata
(``reqs_to_recv`` with local and remote block ids, ``reqs_to_send``), copies the remote
engine's blocks as NIXL's pull worker does (the remote blocks' tail when the decode
holds a prefix locally), and reports the receive finished, and the send once read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)

# By (TP rank, prompt): each rank stores and loads its own heads.
STORE: dict[tuple[int, tuple[int, ...]], dict[str, torch.Tensor]] = {}
DAMAGE: dict[str, Any] = {}
LATENCY = {"steps": 0}
# Per TP rank: steps a load takes past LATENCY; ranks whose next load fails (reported
# finished and failed, as a transfer error is).
RANK_LATENCY: dict[int, int] = {}
FAILING_RANKS: set[int] = set()
# Every engine's workers' caches by (engine id, TP rank), in the order they register
# (their rank); NixlWire: the remote requests whose blocks a decode engine has read.
ENGINES: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
READ: set[str] = set()


def reset() -> None:
    STORE.clear()
    DAMAGE.clear()
    ENGINES.clear()
    READ.clear()
    LATENCY["steps"] = 0
    RANK_LATENCY.clear()
    FAILING_RANKS.clear()


def damage(cache: torch.Tensor, name: str, block: int, position: int, load: int = 0) -> None:
    """Flip one bit of a loaded block when ``DAMAGE`` names this layer and position (and,
    with ``"loads"``, this worker's load count)."""
    named = DAMAGE.get("layer") == name and DAMAGE.get("position") == position
    if named and load in DAMAGE.get("loads", (load,)):
        cache[block].view(torch.int16)[0, 0, 0] ^= 0x100


@dataclass
class StoreMetadata(KVConnectorMetadata):
    saves: list[tuple[tuple[int, ...], list[int]]] = field(default_factory=list)
    loads: list[tuple[str, tuple[int, ...], int, list[int]]] = field(default_factory=list)


class _WholeBlocks(KVConnectorBase_V1):
    """A connector that moves whole blocks between steps: no per-layer hooks."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return


class AsyncStoreConnector(_WholeBlocks):
    """Saves each prompt's blocks once computed; loads them asynchronously."""

    LOADS_ASYNC = True

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._local: dict[str, int] = {}
        self._loads: list[tuple[str, tuple[int, ...], int, list[int]]] = []
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._tables: dict[str, list[int]] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._in_flight: dict[str, int] = {}
        self.loads = 0

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        key = tuple(request.prompt_token_ids)
        if (0, key) in STORE and len(key) > num_computed_tokens:
            self._local[request.request_id] = num_computed_tokens
            return len(key) - num_computed_tokens, self.LOADS_ASYNC
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local = self._local.pop(request.request_id, 0)
        if num_external_tokens > 0:
            key = tuple(request.prompt_token_ids)
            first = local // self.block_size
            self._loads.append((request.request_id, key, first, blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Loads allocated this step; saves of prompts whose last chunk runs this step."""
        meta = StoreMetadata()
        steps = [
            (new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens)
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            steps.append((rid, None, cached.new_block_ids[i], cached.num_computed_tokens[i]))
        for rid, prompt, new_ids, computed in steps:
            if prompt is not None:
                self._prompts[rid], self._tables[rid] = tuple(prompt), []
            if rid not in self._prompts:
                continue
            if new_ids is not None:
                self._tables[rid].extend(new_ids[0])
            key = self._prompts[rid]
            if computed + scheduler_output.num_scheduled_tokens[rid] >= len(key):
                if (0, key) not in STORE:
                    meta.saves.append((key, list(self._tables[rid])))
                del self._prompts[rid], self._tables[rid]
        meta.loads, self._loads = self._loads, []
        return meta

    # Worker side.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = kv_caches
        engine = self._vllm_config.kv_transfer_config.engine_id
        self.rank = sum(1 for e, _ in ENGINES if e == engine)
        ENGINES[(engine, self.rank)] = kv_caches

    def _load(self, rid: str, key: tuple[int, ...], first: int, ids: list[int]) -> None:
        count = -(-len(key) // self.block_size)
        self.loads += 1
        for name, cache in self._caches.items():
            stored = STORE[(self.rank, key)][name]
            for position in range(first, count):
                cache[ids[position]] = stored[position]
                damage(cache, name, ids[position], position, self.loads)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        for rid, key, first, ids in meta.loads:
            self._load(rid, key, first, ids)
            if self.LOADS_ASYNC:
                self._in_flight[rid] = LATENCY["steps"] + RANK_LATENCY.get(self.rank, 0)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        for key, ids in meta.saves:
            count = -(-len(key) // self.block_size)
            STORE.setdefault((self.rank, key), {}).update(
                {name: cache[ids[:count]].clone() for name, cache in self._caches.items()}
            )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = {rid for rid, left in self._in_flight.items() if left <= 0}
        self._in_flight = {rid: left - 1 for rid, left in self._in_flight.items() if left > 0}
        failed = set(done) if self.rank in FAILING_RANKS else set()
        if failed:
            FAILING_RANKS.discard(self.rank)  # once: vLLM's retry of the load then succeeds
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)


class SyncStoreConnector(AsyncStoreConnector):
    """The store, loaded synchronously: a connector kvaudit knows nothing of."""

    LOADS_ASYNC = False


class NixlWire(_WholeBlocks, SupportsHMA):
    """NIXL's pull transfer between in-process engines, driven by NIXL's metadata."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.rank = 0
        self._caches: dict[str, torch.Tensor] = {}
        self._received: set[str] = set()
        self._sending: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = kv_caches
        self.rank = sum(1 for engine, _ in ENGINES if engine == self.engine_id)
        ENGINES[(self.engine_id, self.rank)] = kv_caches

    # The scheduler side is vLLM's NixlConnector; these are never called.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        raise AssertionError("NixlWire is a worker side only")

    update_state_after_alloc = build_connector_meta = get_num_new_matched_tokens

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for rid, req in meta.reqs_to_recv.items():
            remote = req.remote
            local = list(req.local_block_ids[0]) if req.local_block_ids else []
            if local:
                ids = list(remote.block_ids[0])
                # NIXL reads the remote blocks' tail when the decode holds a prefix.
                ids = ids[-len(local) :]
                first = len(remote.block_ids[0]) - len(local)
                source = ENGINES[(remote.engine_id, self.rank)]
                for name, cache in self._caches.items():
                    for offset, (mine, theirs) in enumerate(zip(local, ids, strict=True)):
                        cache[mine] = source[name][theirs]
                        damage(cache, name, mine, first + offset)
            READ.add(remote.request_id)
            self._received.add(rid)
        self._sending.update(meta.reqs_to_send)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        received, self._received = self._received, set()
        sent = {rid for rid in self._sending if rid in READ}
        for rid in sent:
            del self._sending[rid]
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received)
