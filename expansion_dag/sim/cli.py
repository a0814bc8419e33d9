"""``expansion-sim``: run simulated SGLang servers, one per port, in one process.

Flag names mirror ``python -m sglang.launch_server`` where SGLang has one, so a real fleet's launch
command can be pointed at the simulator for a dry run; SGLang flags the simulator does not model
(``--mem-fraction-static 0.9``, ``--attention-backend fa3``, ...) are accepted and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

import yaml

from expansion_dag.sim.config import (
    ANSWER_DEFECTS,
    BACKENDS,
    OLDEST_SGLANG_VERSION,
    REASONING_PARSERS,
    SGLANG_VERSION,
    VLLM_VERSION,
    SimServerConfig,
)
from expansion_dag.sim.server import SimServer

logger = logging.getLogger("expansion_dag.sim")

_DEFAULTS = SimServerConfig()


def _port_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PORT or FIRST-LAST, got {text!r}") from None
    if low > high:
        raise argparse.ArgumentTypeError(f"empty port range {text!r}")
    return list(range(low, high + 1))


def _knob(group: Any, flag: str, kind: type, text: str | None = None) -> None:
    """A flag of ``group`` (an argument group) whose default is ``SimServerConfig``'s field of the same name."""
    group.add_argument(flag, type=kind, default=getattr(_DEFAULTS, flag.removeprefix("--").replace("-", "_")), help=text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="expansion-sim",
        description=(
            "SGLang-compatible fleet SIMULATOR: no model runs, answers are synthetic. Starts one "
            "simulated server per port in this process, each with its own slots, queue and stats. "
            "Unknown sglang.launch_server flags are accepted and ignored."
        ),
        allow_abbrev=False,  # an unknown sglang flag must never be taken for a prefix of ours
    )
    sg = p.add_argument_group("flags shared with sglang.launch_server")
    sg.add_argument("--model-path", default=_DEFAULTS.model_path)
    sg.add_argument("--served-model-name", default=None)
    sg.add_argument(
        "--tokenizer-path",
        default=_DEFAULTS.tokenizer,
        help="tokenizer folder or hub id (default: the bundled Qwen3 tokenizer)",
    )
    sg.add_argument("--host", default=_DEFAULTS.host)
    sg.add_argument(
        "--port", type=int, action="append", default=[], help="repeatable: one simulated server per port"
    )
    sg.add_argument("--context-length", type=int, default=_DEFAULTS.context_length)
    sg.add_argument("--max-running-requests", type=int, default=_DEFAULTS.max_running_requests)
    sg.add_argument("--max-queued-requests", type=int, default=None)
    _knob(sg, "--stream-interval", int, "tokens per streamed event")
    # Like SGLang, only the flag (or --config) sets a key: SGLang reads no environment variable for
    # it. As vLLM, with --backend vllm, VLLM_API_KEY sets it too (serve/middleware/register.py).
    sg.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)")
    sg.add_argument(
        "--config",
        default=None,
        help="a YAML file of these flags' values, e.g. 'api-key: KEY' (SGLang's --config; the command line wins)",
    )
    sg.add_argument(
        "--weight-version", default=_DEFAULTS.weight_version, help="the weights' version the server reports"
    )
    sg.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV cache tokens (default: slots x context)"
    )
    sg.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None)
    sg.add_argument(
        "--tool-call-parser", default=None, help="parse tool calls into message.tool_calls (any name: Hermes format)"
    )
    sg.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="vLLM's flag: its tool parser runs only with it"
    )
    sg.add_argument("--random-seed", "--seed", dest="seed", type=int, default=_DEFAULTS.seed)
    sg.add_argument("--log-level", default="info")

    sim = p.add_argument_group("simulator-only flags")
    sim.add_argument(
        "--ports",
        type=_port_range,
        action="append",
        default=[],
        help="a port range FIRST-LAST, e.g. 30000-30007",
    )
    sim.add_argument(
        "--backend", choices=BACKENDS, default=_DEFAULTS.backend, help="whose HTTP behaviour to simulate"
    )
    sim.add_argument(
        "--emulate-version",
        default=None,
        help=(
            f"the server version whose HTTP surface to emulate: SGLang {OLDEST_SGLANG_VERSION} to "
            f"{SGLANG_VERSION} (default), or vLLM {VLLM_VERSION}"
        ),
    )
    sim.add_argument("--ttft-ms", type=float, default=_DEFAULTS.ttft_s * 1000)
    sim.add_argument(
        "--token-latency-ms", type=float, default=_DEFAULTS.token_latency_s * 1000, help="per output token"
    )
    sim.add_argument("--output-median-tokens", type=int, default=_DEFAULTS.output_median_tokens)
    _knob(sim, "--output-sigma", float, "lognormal sigma of output lengths")
    sim.add_argument(
        "--output-median-by-marker",
        action="append",
        type=_marker_median,
        default=[],
        metavar="MARKER=TOKENS",
        help="median answer length of prompts containing MARKER (repeatable; the first match wins)",
    )
    _knob(sim, "--output-prompt-exponent", float, "answer medians scale as (prompt tokens / 64) ** this")
    _knob(
        sim, "--output-max-tokens", int,
        "the longest natural answer (default: the context length); under the requests' cap, only loops reach it",
    )
    _knob(sim, "--reasoning-share", float, "share of a thinking answer spent thinking")
    _knob(sim, "--startup-delay-s", float, "connections refused this long")
    _knob(sim, "--warmup-s", float, "/health answers 503 this long")
    sim.add_argument("--fail-rate", type=float, default=_DEFAULTS.fail_rate)
    sim.add_argument("--fail-status", type=int, default=_DEFAULTS.fail_status)
    sim.add_argument("--die-after-requests", type=int, default=None)
    sim.add_argument("--hang-rate", type=float, default=_DEFAULTS.hang_rate)
    _knob(
        sim, "--abort-rate", float,
        'share of answers cut halfway with finish_reason "abort" (HTTP 200, partial text)',
    )
    _knob(sim, "--loop-rate", float, "share of answers that degenerate into a loop repeating one span until the cap")
    _knob(
        sim, "--looping-prompt-share", float,
        "share of prompts (chosen by their text) that loop every time they are asked, as real models do",
    )
    sim.add_argument(
        "--answer-defect",
        choices=ANSWER_DEFECTS,
        default=None,
        help="give every answer a misconfigured fleet's defect (answers the training set leaves out)",
    )
    _knob(
        sim, "--output-word-sigma", float,
        "spread of the per-word effects on answer lengths: lengths follow what the prompt says (0: off)",
    )
    _knob(
        sim, "--output-phrase-sigma", float,
        "spread of the per-phrase (adjacent word pair) effects on answer lengths: what single words do not tell (0: off)",
    )
    sim.add_argument("--prompt-token-skew", type=int, default=_DEFAULTS.prompt_token_skew)
    sim.add_argument(
        "--no-token-ids",
        dest="token_ids",
        action="store_false",
        help="ignore requests for token ids, as SGLang before 0.5.20 does",
    )
    _knob(
        sim, "--tool-call-share", float,
        "share of answers to requests with tools that call one (chosen by the prompt)",
    )
    return p


def _marker_median(text: str) -> tuple[str, int]:
    marker, sep, tokens = text.rpartition("=")
    if not sep or not marker or not tokens.isdigit():
        raise argparse.ArgumentTypeError(f"expected MARKER=TOKENS, got {text!r}")
    return marker, int(tokens)


def _configs(args: argparse.Namespace) -> list[SimServerConfig]:
    ports = list(dict.fromkeys([*args.port, *(port for r in args.ports for port in r)])) or [_DEFAULTS.port]
    # Most flags are the config's field of the same name; these are said otherwise on the command line.
    said_otherwise = dict(
        port=ports[0],
        tokenizer=args.tokenizer_path,
        # An empty --api-key sets no key, as on SGLang.
        api_key=args.api_key or (os.environ.get("VLLM_API_KEY") if args.backend == "vllm" else None) or None,
        tool_call_parser=args.tool_call_parser or None,
        version=args.emulate_version,
        ttft_s=args.ttft_ms / 1000,
        token_latency_s=args.token_latency_ms / 1000,
        output_median_by_marker=tuple(args.output_median_by_marker),
    )
    same = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SimServerConfig)
        if f.name not in said_otherwise and hasattr(args, f.name)
    }
    base = SimServerConfig(**same, **said_otherwise)
    return [dataclasses.replace(base, port=port) for port in ports]


async def _serve(configs: list[SimServerConfig]) -> int:
    servers = [SimServer(config) for config in configs]
    for server in servers:
        server.start()
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    all_stopped = asyncio.gather(*(s.wait_stopped() for s in servers))
    signal_wait = asyncio.ensure_future(signalled.wait())
    await asyncio.wait([all_stopped, signal_wait], return_when=asyncio.FIRST_COMPLETED)
    if signalled.is_set():
        for server in servers:
            server.stop("shut down by signal")
        await all_stopped
        return 0
    signal_wait.cancel()
    # Every server died (die_after_requests): exit like the crashed process it simulates.
    logger.error("every simulated server has stopped; exiting")
    return 1


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, with those of ``--config`` as SGLang reads them: a YAML mapping of flag names
    (``api-key`` or ``api_key``) to values, below the command line's own."""
    args, ignored = parser.parse_known_args(argv)
    if args.config is None:
        return args, ignored
    try:
        with open(args.config, encoding="utf-8") as fh:
            values = yaml.safe_load(fh) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config {args.config}: must be a mapping of flag names to values")
    parser.set_defaults(**{str(key).replace("-", "_"): value for key, value in values.items()})
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, ignored = _with_config_file(parser, argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stdout,
        format="[%(asctime)s] %(message)s",
    )
    try:
        configs = _configs(args)
    except ValueError as exc:
        parser.error(str(exc))
    if ignored:
        logger.info("simulator ignores flags it does not model: %s", " ".join(ignored))
    logger.info(
        "SGLang fleet SIMULATOR (no model runs): %d %s %s server(s) on %s, %d slots each",
        len(configs),
        configs[0].backend,
        configs[0].server_version,
        ", ".join(f"{c.host}:{c.port}" for c in configs),
        configs[0].max_running_requests,
    )
    try:
        return asyncio.run(_serve(configs))
    except OSError as exc:  # a port already taken, an address that cannot be bound
        logger.error("simulator could not start: %s", exc)
        return 1
