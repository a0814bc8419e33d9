"""The generation clients' network layer, over real sockets: a small HTTP/1.1 server on 127.0.0.1
whose misbehaviours are chosen per request path."""

import asyncio
import contextlib
import json
import ssl

import httpcore
import httpx
import pytest
import trustme

from expansion_dag.core import ConnectError, TimeoutError_
from expansion_dag.servers import (
    SGLANG,
    VLLM,
    AsyncioStream,
    AsyncioTransport,
    asyncio_transport,
    chat_request,
    make_client,
    send_chat,
)
from expansion_dag_tests.helpers import default_sampling, until
from expansion_dag_tests.ports import free_ports

STREAMED = chat_request("m", [], 9, default_sampling(), stream=True)
PLAIN = chat_request("m", [], 9, default_sampling())
BIG = bytes(range(256)) * (5 * 4096)  # 5 MiB, past the read buffer's high-water mark
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(3)]
CHAT = [
    b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n',
]
COMPLETION = (
    '{"choices":[{"index":0,"message":{"role":"assistant","content":"Grüße, %s"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":3,"completion_tokens":9000}}' % ("x" * 70_000)
).encode()  # past one socket read (a usage that could hold that text)


def watch_connections(loop: asyncio.AbstractEventLoop) -> list[asyncio.Transport]:
    """Each transport ``loop`` opens for a client from now on, through asyncio's own public calls
    (a TLS one after the TCP one beneath it): what the client reads and writes through."""
    opened: list[asyncio.Transport] = []
    create_connection, start_tls = loop.create_connection, loop.start_tls

    async def connected(*args, **kwargs):
        transport, protocol = await create_connection(*args, **kwargs)
        opened.append(transport)
        return transport, protocol

    async def secured(*args, **kwargs):
        transport = await start_tls(*args, **kwargs)
        opened.append(transport)
        return transport

    loop.create_connection, loop.start_tls = connected, secured
    return opened


class Server:
    """Answers by path; counts the connections it accepted. ``clients``: the client's transports."""

    def __init__(self, clients: list[asyncio.Transport]):
        self.clients = clients
        self.connections = 0
        self.head = b""
        self.body = b""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = self.head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                path = head.split(b" ")[1].decode().split("/")[1]  # send_chat appends its own path
                if path == "echo-late":  # nothing read until the client's writes wait: its buffers are full
                    await until(lambda: any(t.get_write_buffer_size() > t.get_write_buffer_limits()[1]
                                            for t in self.clients), "the client's writes to wait")
                self.body = await reader.readexactly(length)
                if not await self.respond(path, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, path: str, writer: asyncio.StreamWriter) -> bool:
        """Write the answer to ``path``; False: close the connection after it."""
        if path in ("events", "chat"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in EVENTS if path == "events" else CHAT:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
            return True
        if path == "completion":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(COMPLETION), COMPLETION))
            return True
        if path == "echo-late":
            size = b"%d" % len(self.body)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(size), size))
            return True
        if path in ("big", "big-then-close"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BIG), BIG))
            await writer.drain()
            return path == "big"
        if path == "silent":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await asyncio.sleep(30)
        if path == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:")
            await writer.drain()
        return False


@contextlib.asynccontextmanager
async def serving(tls: ssl.SSLContext | None = None):
    server = Server(watch_connections(asyncio.get_running_loop()))
    port = free_ports(1)[0]
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port, ssl=tls)
    async with listener:
        yield server, f"{'https' if tls else 'http'}://{'localhost' if tls else '127.0.0.1'}:{port}"


def client(tls: ssl.SSLContext | None = None, timeout_s: float = 10.0):
    """httpx's client on the network layer, for requests of any method and body."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=2.0), transport=asyncio_transport(tls=tls or ssl.create_default_context())
    )


def chat_client(tls: ssl.SSLContext | None = None, timeout_s: float = 10.0):
    """The generation workers' own client on the same layer."""
    return make_client(timeout_s=timeout_s, connect_timeout_s=2.0, tls=tls or ssl.create_default_context())


def test_requests_share_one_kept_alive_connection_and_stream_events_arrive_one_by_one():
    async def main():
        async with serving() as (server, url), client() as c:
            plain = await c.get(f"{url}/big")
            async with c.stream("GET", f"{url}/events") as response:
                assert isinstance(response.extensions["network_stream"], AsyncioStream)
                chunks = [chunk async for chunk in response.aiter_raw()]
            again = await c.get(f"{url}/big")
            return server.connections, plain.content, chunks, again.content

    connections, plain, chunks, again = asyncio.run(main())
    assert connections == 1
    assert plain == again == BIG
    assert chunks == EVENTS  # each event read as the server sent it, not batched at the end


def test_the_workers_client_streams_answers_on_one_kept_alive_connection():
    async def main():
        async with serving() as (server, url), chat_client() as c:
            answers = [await send_chat(c, f"{url}/chat", STREAMED, SGLANG, stream_interval=1) for _ in range(3)]
            return server.connections, answers

    connections, answers = asyncio.run(main())
    assert connections == 1
    assert [(a.content, a.finish_reason, a.completion_tokens) for a in answers] == [("Hello", "stop", 1)] * 3


def test_the_workers_client_sends_the_headers_servers_route_and_frame_by_and_reads_plain_answers_whole():
    """Host with the port (proxies route by it), the JSON type, the body's exact length (a server
    frames the request by it) and the key; a plain answer longer than one read arrives whole."""
    request = chat_request("m", [{"role": "user", "content": "héllo ✓"}], 9, default_sampling())

    async def main():
        async with serving() as (server, url):
            async with make_client(timeout_s=10.0, connect_timeout_s=2.0, api_key="sk-1") as c:
                answers = [
                    await send_chat(c, f"{url}/completion", request, SGLANG, stream_interval=1) for _ in range(2)
                ]
            return server, url, answers

    server, url, answers = asyncio.run(main())
    head = dict(line.split(b": ", 1) for line in server.head.strip().split(b"\r\n")[1:])
    assert {k.lower(): v for k, v in head.items()} == {
        b"host": url.removeprefix("http://").encode(),
        b"content-type": b"application/json",
        b"content-length": b"%d" % len(server.body),
        b"authorization": b"Bearer sk-1",
    }
    assert json.loads(server.body) == request.body()
    assert server.connections == 1
    whole = ("Grüße, " + "x" * 70_000, "stop", 9000)
    assert [(a.content, a.finish_reason, a.completion_tokens) for a in answers] == [whole] * 2


def test_a_body_left_unread_closes_its_connection_and_another_server_gets_its_own():
    """A stopped loop leaves its stream unread: that connection must not carry the next request.
    The spill loop polls several servers on one client: each poll reaches the server it names."""
    async def main():
        async with serving() as (server, url), serving() as (other, other_url), chat_client() as c:
            response = await c.post(f"{url}/events/v1/chat/completions", STREAMED.body())
            async for _ in response.stream:
                break  # one event read, the rest left on the wire
            await response.aclose()
            after_stop = await send_chat(c, f"{url}/chat", STREAMED, SGLANG, stream_interval=1)
            elsewhere = await send_chat(c, f"{other_url}/chat", STREAMED, SGLANG, stream_interval=1)
            back = await send_chat(c, f"{url}/chat", STREAMED, SGLANG, stream_interval=1)
            return server.connections, other.connections, [after_stop, elsewhere, back]

    connections, other_connections, answers = asyncio.run(main())
    assert (connections, other_connections) == (3, 1)
    assert [a.content for a in answers] == ["Hello"] * 3


async def read_slowly(c, server, url):
    async with c.stream("GET", f"{url}/big") as response:
        # Nothing read until the connection stops reading its socket, past the high-water mark: the
        # rest of the body waits in the kernel, not in this process.
        await until(lambda: not server.clients[-1].is_reading(), "the connection to pause reading")
        return b"".join([chunk async for chunk in response.aiter_raw()])


def test_a_large_body_read_slowly_arrives_whole():
    async def main():
        async with serving() as (server, url), client() as c:
            return await read_slowly(c, server, url)

    assert asyncio.run(main()) == BIG


def test_a_large_request_body_to_a_server_that_reads_late_is_sent_whole():
    async def main():
        async with serving() as (server, url), client() as c:
            response = await c.post(f"{url}/echo-late", content=BIG)
            return int(response.text), server.body

    length, received = asyncio.run(main())
    assert (length, received) == (len(BIG), BIG)


def test_a_connection_the_server_closed_while_idle_is_replaced_not_reused():
    async def main():
        async with serving() as (server, url), client() as c:
            first = await c.get(f"{url}/big-then-close")
            await until(lambda: server.clients[0].is_closing(), "the server's close to reach the idle connection")
            second = await c.get(f"{url}/big")
            return server.connections, first.content, second.content

    connections, first, second = asyncio.run(main())
    assert (connections, first, second) == (2, BIG, BIG)


def test_a_server_silent_past_the_read_timeout_is_a_timeout_and_a_cut_stream_a_connect_error():
    async def main():
        async with serving() as (_, url), chat_client(timeout_s=0.3) as c:
            errors = []
            for path in ("silent", "cut"):
                with pytest.raises((TimeoutError_, ConnectError)) as caught:
                    await send_chat(c, f"{url}/{path}", STREAMED, SGLANG, stream_interval=1)
                errors.append(caught.value.kind)
            return errors

    assert asyncio.run(main()) == ["timeout", "connect"]


def test_httpx_errors_come_out_of_connecting_and_of_reading_the_body():
    """What the callers catch: httpx's classes, whether the request fails or its body does."""
    async def main():
        errors = []
        async with serving() as (_, url), chat_client(timeout_s=0.3) as c:
            for path in ("silent", "cut"):
                response = await c.post(f"{url}/{path}", {"model": "m"})
                try:
                    with pytest.raises(httpx.TransportError) as caught:
                        async for _ in response.stream:
                            pass
                finally:
                    await response.aclose()
                errors.append(type(caught.value))
            with pytest.raises(httpx.TransportError) as caught:
                await c.post(f"http://127.0.0.1:{free_ports(1)[0]}", {"model": "m"})
            errors.append(type(caught.value))
        return errors

    assert asyncio.run(main()) == [httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ConnectError]


class Failing:
    """A connection whose request, or else its body after one chunk, raises ``error``."""

    def __init__(self, error: Exception, *, in_body: bool):
        self.error = error
        self.in_body = in_body

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        if not self.in_body:
            raise self.error

        async def body():
            yield b"data"
            raise self.error

        return httpcore.Response(200, content=body())

    async def aclose(self) -> None:
        pass


class OddTimeout(httpcore.ReadTimeout):
    """A subclass the table does not name: it maps as its nearest ancestor that it does."""


@pytest.mark.parametrize("in_body", [False, True], ids=["request", "body"])
@pytest.mark.parametrize("error", [
    httpcore.ConnectTimeout, httpcore.ReadTimeout, httpcore.WriteTimeout, httpcore.PoolTimeout,
    httpcore.TimeoutException, httpcore.ConnectError, httpcore.ReadError, httpcore.WriteError,
    httpcore.NetworkError, httpcore.LocalProtocolError, httpcore.RemoteProtocolError,
    httpcore.ProtocolError, httpcore.ProxyError, httpcore.UnsupportedProtocol, OddTimeout,
])
def test_each_httpcore_error_becomes_httpx_s_of_the_same_name_with_its_message(error, in_body):
    async def main():
        transport = AsyncioTransport(Failing(error("the reason"), in_body=in_body))
        response = None
        with pytest.raises(httpx.TransportError) as caught:
            response = await transport.handle_async_request(httpx.Request("GET", "http://127.0.0.1:9/"))
            async for _ in response.stream:
                pass
        assert (response is None) == (not in_body)
        return caught.value

    raised = asyncio.run(main())
    expected = getattr(httpx, "ReadTimeout" if error is OddTimeout else error.__name__)
    assert (type(raised), str(raised), type(raised.__cause__)) == (expected, "the reason", error)


def test_a_refused_connection_is_a_connect_error():
    async def main():
        async with chat_client() as c:
            with pytest.raises(ConnectError, match="ConnectError"):
                await send_chat(c, f"http://127.0.0.1:{free_ports(1)[0]}", PLAIN, VLLM, stream_interval=1)

    asyncio.run(main())


def test_tls_is_verified_against_the_shared_context():
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_tls)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)

    async def main():
        async with serving(server_tls) as (server, url):
            async with client(trusting) as c:
                body = await read_slowly(c, server, url)
            async with chat_client() as c:  # the system's CAs only: this server's certificate is unknown
                with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await send_chat(c, url, PLAIN, VLLM, stream_interval=1)
            return body

    assert asyncio.run(main()) == BIG
