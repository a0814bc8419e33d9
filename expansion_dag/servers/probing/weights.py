"""Which weights a fleet serves: named where they can be, and pinned by what they do.

A path names no weights: a fine-tune copied over ``/models/target``, or a new hub revision of
``Qwen/Qwen3-8B``, is served under the old path. So a completion's identity names the weights too
(``FleetInfo.identity``), from what can be known of them:

- launch mode: the model folder (:func:`folder_weights`): a hub snapshot's commit where the folder
  is one (``.../snapshots/<commit>``, or a hub id in this machine's hub cache), else a digest of its
  weight files' names, sizes, headers and a sample of each tensor's bytes (a few MB read of a
  16 GB model: a fine-tune changes every tensor's bytes, but not its names, shapes or sizes);
- both modes: the configured ``model.revision``, and the version a server reports for its
  weights (SGLang's ``weight_version``, when it is set: "default" says nothing);
- and, before any prompt is sent, a probe (:func:`probe_fleet_weights`): a fixed prompt's greedy
  answer, asked of every server by a night's budget (they must agree) and of its own server by a
  shard's run (it must agree with what the store recorded for the identity before:
  ``IdentityRegistry.register``). It catches other weights behind one path that nothing else
  names (an attached vLLM reports none of the above).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

from huggingface_hub.constants import HF_HUB_CACHE

from expansion_dag.core import FleetMismatchError, RequestError, SamplingSettings, WeightsProbe, describe
from expansion_dag.servers.probing.fleet import FleetInfo, ServerInfo
from expansion_dag.servers.sending import RetryPolicy, generate
from expansion_dag.servers.transport import async_client
from expansion_dag.servers.wire import chat_request

#: Files whose bytes are the weights; of the others only the model's config is read (whole).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_NAMES = ("config.json", "generation_config.json")
#: Bytes read at each sampled place: the start, middle and end of every tensor of a safetensors
#: file; ``_SAMPLES`` places spread over any other weight file.
_SAMPLE = 4096
_SAMPLES = 64
_COMMIT = re.compile(r"[0-9a-f]{40}")

#: The probe: a prompt whose answer is a few dozen words of the model's own choosing, decoded
#: greedily (temperature 0, seed 0), one request at a time.
PROBE_MESSAGES = ({"role": "user", "content": "Write four short lines about a lighthouse keeper who counts ships."},)
PROBE_TOKENS = 32
#: The probe's tokens compared while a run goes (:func:`reprobe_difference`).
REPROBE_TOKENS = 8
PROBE_SAMPLING = SamplingSettings(
    temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, seed=0, max_output_tokens=PROBE_TOKENS
)
#: A server that fails the probe now and then is asked again, briefly; the canary judges it after.
PROBE_POLICY = RetryPolicy(
    attempts=3, wait_initial_s=0.5, wait_max_s=5.0, wait_jitter_s=0.5, context_retry=True, margin=16,
    min_output_tokens=16, backpressure_wait_s=60.0,
)


def folder_weights(model_path: str, revision: str | None = None) -> str | None:
    """The weights at ``model_path`` as a label: ``commit <sha>`` for a hub snapshot, ``files
    <digest>`` for another folder (or a single weight file, a GGUF); None when the path is none of
    these nor in the hub cache."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        resolved = path.resolve()
        if resolved.parent.name == "snapshots" and _COMMIT.fullmatch(resolved.name):
            return f"commit {resolved.name}"
        return f"files {files_digest(resolved)}"
    if path.is_file():
        return f"files {files_digest(path.resolve().parent, only=path.name)}"
    commit = hub_commit(model_path, revision)
    return None if commit is None else f"commit {commit}"


def hub_commit(repo_id: str, revision: str | None = None) -> str | None:
    """The commit of ``repo_id`` at ``revision`` (default ``main``) in this machine's hub cache, as
    a server launched here downloads it; None when it is not there."""
    folder = Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    wanted = revision or "main"
    if _COMMIT.fullmatch(wanted):
        return wanted if (folder / "snapshots" / wanted).is_dir() else None
    try:
        commit = (folder / "refs" / wanted).read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def files_digest(folder: Path, only: str | None = None) -> str:
    """A digest of a model folder's weights (``only``: of that one file in it): each weight file's
    name, size and samples of its bytes (a safetensors file's header, and the start, middle and end
    of every tensor), and the model's config. 16 hex digits."""
    digest = hashlib.sha256()
    files = [folder / only] if only else [p for p in folder.rglob("*") if _shapes_answers(p, folder)]
    for path in sorted(files):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}\0{size}\n".encode())
        with open(path, "rb") as fh:
            if path.suffix == ".safetensors":
                _safetensors_samples(fh, size, digest)
            elif path.suffix in WEIGHT_SUFFIXES:
                for offset in _spread(0, size, _SAMPLES):
                    fh.seek(offset)
                    digest.update(fh.read(_SAMPLE))
            else:
                digest.update(fh.read())
    return digest.hexdigest()[:16]


def _shapes_answers(path: Path, folder: Path) -> bool:
    hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
    named = path.suffix in WEIGHT_SUFFIXES or path.name in _CONFIG_NAMES or path.name.endswith(".index.json")
    return not hidden and named and path.is_file()


def _safetensors_samples(fh, size: int, digest) -> None:  # type: ignore[no-untyped-def]
    """The header (names, dtypes, shapes, offsets) and three samples of every tensor's bytes."""
    length = int.from_bytes(fh.read(8), "little")
    header = fh.read(min(length, size))
    digest.update(header)
    try:
        tensors = json.loads(header)
        ranges = sorted(tuple(t["data_offsets"]) for name, t in tensors.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        ranges = [(0, size - 8 - len(header))]  # not a header this reads: the data spread as one range
    base = 8 + len(header)
    for begin, end in ranges:
        for offset in _spread(begin, end, 3):
            fh.seek(base + offset)
            digest.update(fh.read(min(_SAMPLE, end - offset)))


def _spread(begin: int, end: int, count: int) -> list[int]:
    """``count`` offsets from ``begin`` to the last sample's place before ``end``, evenly apart."""
    last = max(begin, end - _SAMPLE)
    if count == 1 or last == begin:
        return [begin]
    return sorted({begin + (last - begin) * i // (count - 1) for i in range(count)})


def weights_label(*parts: str | None) -> str:
    """What is known of the weights, as a label (parts that say nothing left out); "" for nothing."""
    return ", ".join(p for p in parts if p)


def probe_fleet_weights(fleet: FleetInfo, *, api_key: str | None) -> FleetInfo:
    """``fleet`` with every server's probe taken.

    A server that does not answer the probe (after ``PROBE_POLICY``'s tries) keeps ``probe``
    None and says why in ``probe_error``: nothing of its weights is compared, and the canary
    judges it. Servers that answer differently on one engine build serve different weights:
    ``FleetMismatchError``, naming them.
    """
    results = asyncio.run(_probe_all(fleet.servers, api_key))
    servers = tuple(
        replace(s, probe=r) if isinstance(r, WeightsProbe) else replace(s, probe_error=describe(r))
        for s, r in zip(fleet.servers, results, strict=True)
    )
    first: dict[str, ServerInfo] = {}
    for server in servers:
        if server.probe is None:
            continue
        seen = first.setdefault(server.probe.engine, server)
        difference = seen.probe.difference(server.probe)  # type: ignore[union-attr]
        if difference is not None:
            raise FleetMismatchError(
                f"{seen.url} and {server.url} serve {fleet.model_path} with different weights: their answers to "
                f"the weights probe (greedy, sent alone) differ at {difference}. Serve the same weights on every "
                "server of the fleet."
            )
    return replace(fleet, servers=servers)


async def _probe_all(servers: tuple[ServerInfo, ...], api_key: str | None) -> list[WeightsProbe | RequestError]:
    # One request at a time: the probe is alone on each server as far as this client goes.
    return [await probe_weights(server, api_key) for server in servers]


def reprobe_difference(before: WeightsProbe, now: WeightsProbe) -> str | None:
    """Where a probe taken during a run answers otherwise than the run's first, in its first
    ``REPROBE_TOKENS`` tokens (characters ``4 x`` as many without ids); None: the same weights.

    Sent beside a full batch, a greedy answer is no longer sent alone: the batch changes the float
    sums as another engine build does, and a near-tie late in the answer can flip. Other weights
    answer otherwise from the first tokens.
    """
    def head(probe: WeightsProbe) -> WeightsProbe:
        ids = None if probe.ids is None else probe.ids[:REPROBE_TOKENS]
        return replace(probe, text=probe.text[: 4 * REPROBE_TOKENS], ids=ids)

    return head(before).difference(head(now))


async def probe_weights(server: ServerInfo, api_key: str | None) -> WeightsProbe | RequestError:
    """``server``'s answer to the probe, or the error that says why there is none."""
    max_tokens = max(1, min(PROBE_TOKENS, server.context_length // 2))
    request = chat_request(
        server.model, PROBE_MESSAGES, max_tokens, PROBE_SAMPLING, token_ids=server.dialect.token_ids
    )
    async with async_client(timeout_s=300.0, connect_timeout_s=10.0, api_key=api_key) as client:
        exchange = await generate(
            client, server.url, request, server.dialect, PROBE_POLICY, stream_interval=server.stream_interval
        )
    if exchange.error is not None:
        return exchange.error
    answer = exchange.answer
    assert answer is not None
    return WeightsProbe(
        engine=f"{server.backend} {server.version or 'unknown version'}",
        text=(answer.reasoning or "") + answer.content,
        ids=None if answer.output_ids is None else tuple(answer.output_ids),
    )
