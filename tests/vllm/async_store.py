"""A connector that loads asynchronously, as NIXL does: the consumer's load runs between
steps and is reported finished by ``get_transfer_results`` (the request waits in
``WAITING_FOR_REMOTE_KVS`` meanwhile). KV moves through an in-process store keyed by the
prompt's full blocks; ``DAMAGE`` flips one bit of a layer's stored copy before a load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

STORE: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
DAMAGE: dict[str, Any] = {}


@dataclass
class StoreMetadata(KVConnectorMetadata):
    saves: list[tuple[tuple[int, ...], list[int]]] = field(default_factory=list)
    loads: list[tuple[str, tuple[int, ...], list[int]]] = field(default_factory=list)


class AsyncStoreConnector(KVConnectorBase_V1):
    """Saves a new request's full prompt blocks; loads them asynchronously."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._loads: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()

    def _key(self, prompt: list[int]) -> tuple[int, ...]:
        return tuple(prompt[: len(prompt) // self.block_size * self.block_size])

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        key = self._key(list(request.prompt_token_ids))
        if key and key in STORE:
            return len(key) - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            key = self._key(list(request.prompt_token_ids))
            self._loads[request.request_id] = (key, blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = StoreMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens == 0:
                meta.saves.append((self._key(new.prompt_token_ids), list(new.block_ids[0])))
        meta.loads = [(rid, key, ids) for rid, (key, ids) in self._loads.items()]
        self._loads.clear()
        return meta

    # Worker side.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for rid, key, ids in meta.loads:
            blocks = len(key) // self.block_size
            for name, cache in self._caches.items():
                stored = STORE[key][name].clone()
                if DAMAGE.get("layer") == name:
                    stored.view(torch.int16)[DAMAGE["block"], 0, 0, 0] ^= 0x100
                cache[ids[:blocks]] = stored
            self._done.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for key, ids in meta.saves:
            blocks = len(key) // self.block_size
            STORE.setdefault(key, {}).update(
                {name: cache[ids[:blocks]].clone() for name, cache in self._caches.items()}
            )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, self._done = self._done, set()
        return KVConnectorTransferResults(finished_recving=done)
