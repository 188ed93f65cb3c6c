"""A transfer that goes wrong: NIXL, wrapped by kvaudit's connector, with one bit of the received KV
flipped in every load of an odd number of tokens (the decode loads every token of a
prompt: prompts of an odd length arrive damaged, even ones intact).

    "kv_connector": "FaultyConnector",
    "kv_connector_module_path": "faulty_transfer",     # this folder on PYTHONPATH
    "kv_connector_extra_config": {"kvaudit": {...}, "wrapped": {"kv_connector": "NixlConnector"}}

The bit is flipped after NIXL reports the receive finished and before kvaudit checksums
the loaded blocks, as a late write into a reused slot would leave it: element 5 of token 3
of head 1 of the first layer, in the first loaded block. Each planted fault is logged at
WARNING: ``planted fault: request R layer L position P block B head 1 token T element 5``
(R the producer's request id, as kvaudit names it).
"""

from __future__ import annotations

import logging

import torch

# The package, not its class: a config pairing this module with kvaudit's own class
# name then fails to load instead of loading kvaudit's connector without the change.
import kvaudit.integrations.vllm as kvaudit_vllm

logger = logging.getLogger("kvaudit.vllm")

HEAD, TOKEN_IN_BLOCK, ELEMENT = 1, 3, 5


class FaultyConnector(kvaudit_vllm.KVAuditHMAConnector):
    """kvaudit's connector (wrapping NIXL), whose decode workers damage some received KV."""

    def _audited_results(
        self, finished_recving: set[str], failed_recving: set[str], ended: set[str]
    ) -> tuple[set[str], set[str]]:
        for request in sorted(finished_recving - failed_recving):
            self._flip(request)
        return super()._audited_results(finished_recving, failed_recving, ended)

    def _flip(self, request: str) -> None:
        audit = self.worker_audit
        job = audit.waiting_load(request) if audit is not None else None
        if job is None or not job.groups or job.num_tokens % 2 == 0:
            return
        start, blocks = job.groups[min(job.groups)]
        layer = sorted(audit.tensors)[0]
        cache = audit.tensors[layer]  # [blocks, heads, tokens, K then V]
        block_size = int(cache.shape[2])
        cell = cache[blocks[0], HEAD, TOKEN_IN_BLOCK]
        word = cell[ELEMENT : ELEMENT + 1].view(torch.int32)
        word.bitwise_xor_(1 << 29)  # an exponent bit: the value scaled by 2**64
        logger.warning(
            "planted fault: request %s layer %s position %d block %d head %d token %d "
            "element %d", job.audit_id, layer, start, blocks[0], HEAD,
            start * block_size + TOKEN_IN_BLOCK, ELEMENT,
        )  # fmt: skip
