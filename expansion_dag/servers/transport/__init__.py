"""The HTTP transport the project owns: httpx's one seam (an ``httpx.AsyncBaseTransport`` of one
httpcore connection on asyncio's own transports), the workers' client over it, and the event loop
whose selector reads every stream once a tick."""

from expansion_dag.servers.transport.asyncio_network import (
    AsyncioBackend,
    AsyncioStream,
    AsyncioTransport,
    asyncio_transport,
)
from expansion_dag.servers.transport.event_loop import CoalescingSelector, OffLoop, run_ticked
from expansion_dag.servers.transport.http_client import HttpClient, make_client, read_body, tls_context

__all__ = [
    "AsyncioBackend", "AsyncioStream", "AsyncioTransport", "CoalescingSelector", "HttpClient", "OffLoop",
    "asyncio_transport", "make_client", "read_body", "run_ticked", "tls_context",
]
