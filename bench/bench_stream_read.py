"""Client CPU per streamed event, layer by layer, against this machine's floor.

A streamed answer costs the client one network read per event, and at the reference rate every
event arrives alone: the process sleeps, wakes, reads and sleeps again. This benchmark streams the
same events (one chat chunk of ``--event-tokens`` tokens each, spaced by ``--gap-ms``) from a local
server process and measures the client's CPU per event, side by side:

- ``floor: bare asyncio read``: a raw asyncio socket reading the bytes and nothing else. It is what
  waking up for an event costs on this machine; no HTTP client can cost less.
- ``httpx AsyncClient``: httpx's client reading the body, nothing parsed.
- ``send_chat``: the whole streamed request as the engine makes it: the workers' client
  (``servers.async_client``), the SSE and JSON parsing and the loop detector.

Run it with ``PYTHONPATH`` on another tree (a worktree) to measure that tree's ``send_chat`` beside
this one's; the two other rows are the same code in both.

    .venv/bin/python bench/bench_stream_read.py            # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx
from harness import header, http_server_child, serve_http, write_result  # (bench/ is on sys.path when run as a script)

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
from expansion_dag.servers import SGLANG, chat_request, send_chat, tls_context

try:
    from expansion_dag.servers import async_client
except ImportError:  # a tree from before the workers' client was httpx's AsyncClient (issue 52)
    from expansion_dag.servers import make_client as async_client

WORDS = ("the", "model", "answer", "token", "server", "prompt", "shard", "slot", "event", "count", "of", "a")


def events(n: int, tokens: int, seed: int = 0) -> list[bytes]:
    """``n`` chat chunks of ~``tokens`` tokens of varied text (no loop), a finish chunk and the usage."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(tokens // 2))
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        out.append(chunk)
    out.append({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    out.append({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens * n}})
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


async def serve(n: int, tokens: int, gap_s: float) -> None:
    body = events(n, tokens)

    async def respond(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in body:
            await asyncio.sleep(gap_s)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    await serve_http(respond)


REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}


async def bare(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(REQUEST).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    tail = b""
    while not tail.endswith(b"0\r\n\r\n"):
        data = await reader.read(65536)
        if not data:
            break
        tail = (tail + data)[-16:]
    writer.close()


async def read_body(client: httpx.AsyncClient, url: str) -> None:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=REQUEST) as response:
        async for _ in response.aiter_raw():
            pass


async def measure(name: str, url: str, repeats: int, event_tokens: int) -> float:
    """Seconds of this process's CPU over ``repeats`` streamed requests (the client built first)."""
    if name == "floor: bare asyncio read":
        run = lambda: bare(url)  # noqa: E731
        client = None
    elif name == "httpx AsyncClient":
        client = httpx.AsyncClient(verify=tls_context())
        run = lambda: read_body(client, url)  # noqa: E731
    else:
        client = async_client(timeout_s=60.0, connect_timeout_s=5.0)
        chat = chat_request("m", REQUEST["messages"], 1 << 20, sampling_settings(GenerationConfig()), stream=True)
        thresholds = engine_config(GenerationConfig()).loop  # the engine's, as a run configures it
        run = lambda: send_chat(client, url, chat, SGLANG, thresholds, stream_interval=event_tokens)  # noqa: E731
    await run()  # connect and warm up outside the measurement
    cpu = time.process_time()
    for _ in range(repeats):
        await run()
    cpu = time.process_time() - cpu
    if client is not None:
        await client.aclose()
    return cpu


NAMES = ("floor: bare asyncio read", "httpx AsyncClient", "send_chat")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=100, help="events per streamed request")
    p.add_argument("--event-tokens", type=int, default=256, help="tokens per event (the fleet's stream_interval)")
    p.add_argument("--repeats", type=int, default=4, help="requests per measurement")
    p.add_argument("--gap-ms", type=float, nargs="+", default=[1.0, 10.0], help="time between events")
    p.add_argument("--rounds", type=int, default=3, help="each measurement this many times, interleaved; the median is kept")
    p.add_argument("--serve", type=float, help=argparse.SUPPRESS)  # internal: be the server, events every SERVE s
    args = p.parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.events, args.event_tokens, args.serve))
        return 0
    result = header("stream-read", simulator=False, argv=argv)
    result.update({"args": vars(args), "us_cpu_per_event": {}})
    for gap_ms in args.gap_ms:
        with http_server_child([sys.executable, __file__, "--serve", str(gap_ms / 1000), "--events", str(args.events),
                                "--event-tokens", str(args.event_tokens)]) as url:
            samples: dict[str, list[float]] = {name: [] for name in NAMES}
            for _ in range(args.rounds):
                for name in NAMES:
                    seconds = asyncio.run(measure(name, url, args.repeats, args.event_tokens))
                    samples[name].append(1e6 * seconds / (args.repeats * (args.events + 3)))
        figures = {name: round(sorted(s)[len(s) // 2], 1) for name, s in samples.items()}
        result["us_cpu_per_event"][f"{gap_ms:g} ms apart"] = figures
        floor = figures[NAMES[0]]
        print(f"\nevents {gap_ms:g} ms apart: client CPU per event (median of {args.rounds})")
        print(f"| {'layer':<26} | us | above the floor |\n|---|---:|---:|")
        for name, us in figures.items():
            print(f"| {name:<26} | {us:.1f} | {us - floor:.1f} |")
    print(f"\nwritten to {write_result('stream-read', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
