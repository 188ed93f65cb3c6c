"""Integrations of kvaudit into serving engines (``kvaudit.integrations.vllm``)."""
