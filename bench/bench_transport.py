"""Client CPU per request of the network layer's two public seams into httpcore, side by side.

The workers' client (``HttpClient``) sends the same requests to a local server process on one
kept-alive connection, through two transports, both on public APIs only:

- ``baseline: AsyncioTransport on httpcore's pool``: httpcore's ``AsyncConnectionPool`` of one
  connection, given the product's asyncio network backend (``network_backend=``): the seam httpcore
  offers for a backend of one's own.
- ``AsyncioTransport on OneConnection``: the product's (``asyncio_transport``), an httpx
  ``AsyncBaseTransport`` of our own on one ``AsyncHTTP11Connection``.

(The layer before them swapped httpx's private ``_pool``; BENCHMARKS.md's run N1 measured both
against it before it was removed. Nothing here reads or writes a private attribute.)

Two workloads: plain answers (one JSON completion each) and streamed ones (``--events`` chunked
events, each one item of the body's stream). The events are sent at once: the wake-up an event
costs when they come apart is the network layer's, the same under each transport, and its noise
would hide the transports' difference (BENCHMARKS.md, "Client CPU of a streamed event, layer by
layer", measures it). Each measurement is this process's CPU over ``--requests`` requests; the
variants are interleaved, their order rotating, ``--rounds`` times. Figures: each variant's median,
and the median over rounds of its ratio to the baseline measured in the same round.

    .venv/bin/python bench/bench_transport.py            # ~30 s
    .venv/bin/python bench/bench_transport.py --rounds 1 --requests 50   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpcore
import httpx
from harness import header, http_server_child, serve_http, write_result  # (bench/ is on sys.path when run as a script)

from expansion_dag.servers import AsyncioBackend, AsyncioTransport, HttpClient, asyncio_transport, tls_context

COMPLETION = json.dumps({
    "id": "c", "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 400}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 400},
}).encode()
EVENT = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "word " * 200}}]}).encode() + b"\n\n"
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400}
#: Requests a second of the reference fleet (8 servers x 72 slots), all of them fed by one client
#: process (BENCHMARKS.md, W1).
REFERENCE_REQUESTS_PER_S = 3.4


async def serve(events: int) -> None:
    async def respond(head: bytes, writer: asyncio.StreamWriter) -> None:
        if head.startswith(b"POST /plain"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(COMPLETION), COMPLETION))
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(EVENT), EVENT) for _ in range(events)) + b"0\r\n\r\n")

    await serve_http(respond)


def public_pool() -> httpx.AsyncBaseTransport:
    pool = httpcore.AsyncConnectionPool(
        ssl_context=tls_context(), max_connections=1, keepalive_expiry=5.0,
        network_backend=AsyncioBackend(),
    )
    return AsyncioTransport(pool)


VARIANTS = {
    "baseline: AsyncioTransport on httpcore's pool": public_pool,
    "AsyncioTransport on OneConnection: the product's": lambda: asyncio_transport(tls=tls_context()),
}


async def one_request(client: HttpClient, url: str) -> None:
    response = await client.post(url, REQUEST)
    try:
        async for _ in response.stream:  # the body as the workers read it
            pass
    finally:
        await response.aclose()
    assert response.status_code == 200


async def measure(variant: str, url: str, requests: int) -> float:
    """Microseconds of this process's CPU per request over ``requests`` requests (connected first)."""
    async with HttpClient(VARIANTS[variant](), timeout=httpx.Timeout(60.0, connect=5.0, pool=None)) as client:
        await one_request(client, url)
        cpu = time.process_time()
        for _ in range(requests):
            await one_request(client, url)
        return 1e6 * (time.process_time() - cpu) / requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="plain requests per measurement (streamed: a fifth)")
    p.add_argument("--events", type=int, default=20, help="events per streamed answer")
    p.add_argument("--rounds", type=int, default=15, help="each measurement this many times, interleaved")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: be the server
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.events))
        return 0
    result = header("transport", "httpx", "httpcore", "h11", simulator=False, argv=argv)
    result.update({"args": vars(args), "us_cpu_per_request": {}})
    names = list(VARIANTS)
    with http_server_child([sys.executable, __file__, "--serve", "--events", str(args.events)]) as server:
        for workload, requests in (("plain", args.requests), ("streamed", max(1, args.requests // 5))):
            url = f"{server}/{workload}"
            samples: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    samples[name].append(asyncio.run(measure(name, url, requests)))
            figures = {name: round(statistics.median(s), 1) for name, s in samples.items()}
            ratios = {name: round(statistics.median(a / b for a, b in zip(s, samples[names[0]])), 3)
                      for name, s in samples.items()}
            result["us_cpu_per_request"][workload] = {
                "median": figures, "ratio_to_baseline": ratios, "samples": samples, "requests": requests,
            }
            baseline = figures[names[0]]
            print(f"\n{workload}: client CPU per request, median of {args.rounds} x {requests} requests")
            print("| transport | us | / baseline, paired | extra at 3.4 requests/s, share of a core |")
            print("|---|---:|---:|---:|")
            for name, us in figures.items():
                extra = (us - baseline) * 1e-6 * REFERENCE_REQUESTS_PER_S
                print(f"| {name} | {us:.1f} | {ratios[name]:.3f} | {extra:.1e} |")
    print(f"\nwritten to {write_result('transport', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
