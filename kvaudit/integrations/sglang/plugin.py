"""kvaudit's SGLang plug-in entry point (``sglang.srt.plugins``): the hooks of the inline
check (``KVAUDIT_SGLANG_INLINE=1``, ``inline``) and of the live agent
(``KVAUDIT_SGLANG_LIVE=FOLDER``, ``serving``), registered with SGLang's ``HookRegistry``
(docs/sglang.md, "Turning it on").
"""

from __future__ import annotations

import os

from .recording import INLINE_VARIABLE, LIVE_VARIABLE, settings_from_environment


def register() -> None:
    """Register kvaudit's hooks with SGLang's ``HookRegistry``, as the environment asks.

    SGLang's ``load_plugins()`` runs it in every scheduler process. Installing kvaudit
    beside SGLang turns nothing on: without ``KVAUDIT_SGLANG_INLINE=1`` or
    ``KVAUDIT_SGLANG_LIVE`` it registers nothing.

    Raises:
        KvauditError: A ``KVAUDIT_SGLANG_*`` output setting that is not valid (one line).

    """
    chosen = []
    if os.environ.get(INLINE_VARIABLE, "0") == "1":
        settings_from_environment()  # a bad setting stops the engine's start, in one line
        from . import inline

        chosen += inline.hooks()
    if os.environ.get(LIVE_VARIABLE):
        from . import serving

        chosen += serving.hooks()
    if not chosen:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in chosen:
        HookRegistry.register(target, hook, HookType.AROUND)
