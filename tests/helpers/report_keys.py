"""The keys of a diff report's JSON (docs/cli.md), which the report tests check exactly."""

from __future__ import annotations

DIFF_KEYS = {
    "format",
    "ok",
    "diagnosis",
    "positions",
    "unverified",
    "warnings",
    "requests",
    "only_in_producer",
    "only_in_consumer",
    "untraced",
}
GROUP_KEYS = {
    "compared",
    "mismatched_positions",
    "missing_positions",
    "replicas_differing",
    "unverified",
    "positions",
    "located",
    "stale_sources",
    "token_runs",
}
OPTIONAL_GROUP_KEYS = {"stale_matches", "token_shifts", "seed_lane_only"}
"""A group's keys written only where they say something (a list cut short, a shift, a
seed-lane-only verdict)."""
FINDING_KEYS = {"request", "group", "kind", "text", "positions", "tokens", "slices", "located"}
