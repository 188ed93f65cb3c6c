"""Requests that two engines name differently, paired by their prompts.

vLLM's offline P/D (two ``LLM`` instances sharing a connector's storage, no proxy) gives
one prompt's request a different id on each engine (``0-8162a3ba`` on the prefill,
``0-a67d174a`` on the decode). Where both sides know their requests' prompt digests
(``kvaudit.output_folders.prompt_digest``, which output folders' lines carry), a
request held on one side only is paired with the other side's unpaired request of the
same prompt, and the consumer's request takes the producer's id for the comparison.

Several unpaired requests of one prompt on a side (the same prompt sent more than once)
are paired in their order of appearance on each side, and the report says so: each holds
the KV of the same tokens, so whichever pairing is the true one, the KV compared must be
equal, and the order in which an offline batch runs is the likeliest true pairing.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..sources import Source


@dataclass
class Pairing:
    """The two sides after pairing: the consumer with its paired requests renamed to the
    producer's ids; ``pairs`` each ``(producer id, consumer id)``; ``notes`` what the
    report says of them (one line each)."""

    producer: Source
    consumer: Source
    pairs: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def producer_id(self, request_id: str) -> str:
        """The id a request has in the comparison: a paired consumer id becomes its
        producer's id; any other id stays."""
        return next((p for p, c in self.pairs if c == request_id), request_id)


def pair_by_prompt(producer: Source, consumer: Source) -> Pairing:
    """Pair the requests that only one side holds by their prompt digests.

    Requests whose ids both sides hold pair by id. A producer request the consumer lacks
    is paired with the consumer's first request (in order of appearance) of the same
    prompt that the producer lacks and that is not paired yet. Sides that do not know
    their prompts (a record, dumps) are left as they are.

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.

    Returns:
        The sides, the consumer renamed where requests were paired, with the pairs and
        the notes that say so.

    """
    left, right = producer.prompt_digests(), consumer.prompt_digests()
    if not left or not right:
        return Pairing(producer, consumer)
    produced, consumed = producer.request_ids, consumer.request_ids
    held, holding = set(produced), set(consumed)
    waiting: dict[str, deque[str]] = defaultdict(deque)
    for rid in consumed:
        if rid not in held and rid in right:
            waiting[right[rid]].append(rid)
    counts = {digest: len(queue) for digest, queue in waiting.items()}
    unpaired = [rid for rid in produced if rid not in holding and rid in left]
    producers_of: dict[str, list[str]] = defaultdict(list)
    for rid in unpaired:
        producers_of[left[rid]].append(rid)
    pairs = [(rid, waiting[left[rid]].popleft()) for rid in unpaired if waiting.get(left[rid])]
    if not pairs:
        return Pairing(producer, consumer)
    notes = [f"paired by prompt: producer {p} = consumer {c}" for p, c in pairs]
    notes += _ambiguous(pairs, producers_of, counts)
    renamed = consumer.renamed({c: p for p, c in pairs})
    return Pairing(producer, renamed, pairs, notes)


def _ambiguous(
    pairs: Sequence[tuple[str, str]],
    producers_of: dict[str, list[str]],
    consumer_counts: dict[str, int],
) -> list[str]:
    """A note per prompt that several unpaired requests of a side share: they were paired
    in order of appearance."""
    notes = []
    for digest, producers in producers_of.items():
        consumers = consumer_counts.get(digest, 0)
        if min(len(producers), consumers) and max(len(producers), consumers) > 1:
            paired = [f"{p} = {c}" for p, c in pairs if p in producers]
            notes.append(
                f"{len(producers)} producer and {consumers} consumer requests share prompt "
                f"{digest}: paired in order of appearance ({', '.join(paired)}); each holds "
                "the KV of the same tokens"
            )
    return notes
