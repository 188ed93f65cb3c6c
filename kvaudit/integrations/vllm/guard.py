"""The guard around every call vLLM makes into kvaudit's connector: a failure of kvaudit's
own code is logged, counted and turned into "unverified", never raised into the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger("kvaudit.vllm")


class AuditGuard:
    """Catches what kvaudit's part of a connector hook raises, so that the engine goes on
    exactly as it would without kvaudit.

    The wrapped connector's calls are made outside the guard (what they raise is the
    engine's own business, raised as without kvaudit); only kvaudit's own work runs
    inside it. A failure is logged with its traceback the first time it happens in a
    hook (later ones in the same hook in one line), counted in ``internal_errors``, and
    handed to ``on_error``, which reports the requests the audit was handling as
    unverified and lets go of anything it held.

    Example:
        >>> guard = AuditGuard(on_error=lambda hook: None)
        >>> with guard("build_connector_meta"):
        ...     raise RuntimeError("a bug of kvaudit's")
        >>> guard.take_errors()
        1
    """

    def __init__(self, on_error: Callable[[str], None]) -> None:
        """Args:
        on_error: Called with the hook's name after a failure, to report the
            requests in flight as unverified; what it raises is logged, not raised.
        """
        self.on_error = on_error
        self.internal_errors = 0
        self._hooks_logged: set[str] = set()

    @contextmanager
    def __call__(self, hook: str) -> Iterator[None]:
        """Run the block; an ``Exception`` it raises ends the block and is handled here.

        Args:
            hook: The connector hook the block belongs to, named in the log.

        Returns:
            A context manager; code after the ``with`` runs whether the block failed.
        """
        try:
            yield
        except Exception:
            self.internal_errors += 1
            if hook not in self._hooks_logged:
                self._hooks_logged.add(hook)
                logger.exception(
                    "kvaudit: internal error in %s (the engine goes on as without kvaudit; "
                    "the requests kvaudit was checking are unverified)",
                    hook,
                )
            else:
                logger.warning("kvaudit: internal error in %s again (see the first)", hook)
            try:
                self.on_error(hook)
            except Exception:
                logger.exception("kvaudit: internal error while recovering from one in %s", hook)

    def take_errors(self) -> int:
        """The internal errors since the last call.

        Returns:
            How many guarded blocks failed since the last call.
        """
        errors, self.internal_errors = self.internal_errors, 0
        return errors
