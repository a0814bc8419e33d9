"""Sending: one attempt at a chat request, and a prompt's whole exchange with a server, retried."""

from expansion_dag.servers.sending.send import Deadline, Exchange, RetryPolicy, generate, send_chat

__all__ = ["Deadline", "Exchange", "RetryPolicy", "generate", "send_chat"]
