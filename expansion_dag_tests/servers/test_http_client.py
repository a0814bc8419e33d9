"""The generation workers' HTTP client (``servers.async_client``) and ``send_chat`` over real
sockets: a small HTTP/1.1 server on 127.0.0.1 whose answer is chosen per request path."""

import asyncio
import contextlib
import json
import ssl

import pytest
import trustme

import expansion_dag.core.urls as core_urls
from expansion_dag.core import ConnectError, TimeoutError_, server_url
from expansion_dag.servers import SGLANG, VLLM, async_client, chat_request, send_chat
from expansion_dag_tests.helpers import default_sampling
from expansion_dag_tests.ports import free_ports

STREAMED = chat_request("m", [], 9, default_sampling(), stream=True)
PLAIN = chat_request("m", [], 9, default_sampling())
CHAT = [
    b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n',
]
COMPLETION = (
    '{"choices":[{"index":0,"message":{"role":"assistant","content":"Grüße, %s"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":3,"completion_tokens":9000}}' % ("x" * 70_000)
).encode()  # past one socket read (a usage that could hold that text)


class Server:
    """Answers by path; counts the connections it accepted and keeps the last request."""

    def __init__(self) -> None:
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
                self.body = await reader.readexactly(length)
                path = head.split(b" ")[1].decode().split("/")[1]  # send_chat appends its own path
                if not await self.respond(path, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, path: str, writer: asyncio.StreamWriter) -> bool:
        """Write the answer to ``path``; False: close the connection after it."""
        if path in ("chat", "endless"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in CHAT if path == "chat" else [CHAT[0]] * 1000:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            return True
        if path == "completion":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(COMPLETION), COMPLETION))
            return True
        if path == "silent":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await asyncio.sleep(30)
        if path == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:")
            await writer.drain()
        return False


@contextlib.asynccontextmanager
async def serving(tls: ssl.SSLContext | None = None):
    server = Server()
    port = free_ports(1)[0]
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port, ssl=tls)
    async with listener:
        yield server, f"{'https' if tls else 'http'}://{'localhost' if tls else '127.0.0.1'}:{port}"


def chat_client(tls: ssl.SSLContext | None = None, timeout_s: float = 10.0, api_key: str | None = None):
    return async_client(timeout_s=timeout_s, connect_timeout_s=2.0, api_key=api_key,
                        tls=tls or ssl.create_default_context())


def head_of(server: Server) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in (line.split(b": ", 1) for line in server.head.strip().split(b"\r\n")[1:])}


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
        async with serving() as (server, url), chat_client(api_key="sk-1") as c:
            answers = [await send_chat(c, f"{url}/completion", request, SGLANG, stream_interval=1) for _ in range(2)]
            return server, url, answers

    server, url, answers = asyncio.run(main())
    head = head_of(server)
    assert head[b"host"] == url.removeprefix("http://").encode()
    assert head[b"content-type"] == b"application/json"
    assert head[b"content-length"] == b"%d" % len(server.body)
    assert head[b"authorization"] == b"Bearer sk-1"
    assert json.loads(server.body) == request.body()
    assert server.connections == 1
    whole = ("Grüße, " + "x" * 70_000, "stop", 9000)
    assert [(a.content, a.finish_reason, a.completion_tokens) for a in answers] == [whole] * 2


def test_a_server_named_with_credentials_gets_them_in_place_of_the_key(monkeypatch):
    """A server behind a proxy that asks for a password: its URL's ``user:password@``, never the key."""
    # ``server_url`` keeps the credentials for the process: here for this test alone, so a later
    # test's server on the same port is not sent them.
    monkeypatch.setattr(core_urls, "_SERVER_CREDENTIALS", {})

    async def main():
        async with serving() as (server, url):
            named = server_url(url.replace("http://", "http://ops:s3cret@"))
            async with chat_client(api_key="sk-1") as c:
                await send_chat(c, f"{named}/completion", PLAIN, SGLANG, stream_interval=1)
            return head_of(server)

    assert asyncio.run(main())[b"authorization"] == b"Basic b3BzOnMzY3JldA=="  # ops:s3cret


def test_a_stream_stopped_unread_closes_its_connection_and_the_next_request_opens_another():
    """A stopped loop leaves its stream unread: that connection must not carry the next request."""

    async def main():
        async with serving() as (server, url), chat_client() as c:
            request = c.build_request("POST", f"{url}/endless/v1/chat/completions", json=STREAMED.body())
            response = await c.send(request, stream=True)
            async for _ in response.aiter_bytes():
                break  # one event read, the rest left on the wire
            await response.aclose()
            after_stop = await send_chat(c, f"{url}/chat", STREAMED, SGLANG, stream_interval=1)
            return server.connections, after_stop.content

    assert asyncio.run(main()) == (2, "Hello")


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
        async with serving(server_tls) as (_, url):
            async with chat_client(trusting) as c:
                answer = await send_chat(c, f"{url}/chat", STREAMED, SGLANG, stream_interval=1)
            async with async_client(timeout_s=10.0) as c:  # the system's CAs only: this server's certificate is unknown
                with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await send_chat(c, url, PLAIN, VLLM, stream_interval=1)
            return answer.content

    assert asyncio.run(main()) == "Hello"
