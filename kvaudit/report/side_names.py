"""What a report's two sides are called in its tables (``diff``: producer and consumer;
``verify``: what it checks against), apart from the tables so that choosing them
imports no rich."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SideNames:
    """What a report's two sides are called, and what a compared block is.

    ``producer`` names the side that plays the producer, ``consumer`` the one that plays
    the consumer, ``compared`` what a compared block is (``compared``, ``checked``).
    """

    producer: str = "producer"
    consumer: str = "consumer"
    compared: Literal["compared", "checked"] = "compared"


DIFF_SIDE_NAMES = SideNames()
