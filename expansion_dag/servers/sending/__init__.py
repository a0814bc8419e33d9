"""Sending: one attempt at a chat request, and a prompt's whole exchange with a server, retried."""

from expansion_dag.servers.sending.send import Exchange, RetryPolicy, generate, send_chat

__all__ = ["Exchange", "RetryPolicy", "generate", "send_chat"]
