"""Helpers shared by tests: prompt frames and resources bound to a simulated fleet."""

import ssl

import httpx
import polars as pl

from expansion_dag.http_client import HttpClient, make_client
from expansion_dag.resources.fleet import FleetResource
from expansion_dag.resources.settings import GenerationSettings
from expansion_dag.resources.storage import ParquetIOManager, StorageResource

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))


def prompt_frame(texts: list[str], sources: list[str] | None = None) -> pl.DataFrame:
    """Prompt records as extraction produces them, for tests that start at the budget stage."""
    return pl.DataFrame(
        {
            "prompt_id": [f"p{i:05d}" for i in range(len(texts))],
            "source": sources or ["sample"] * len(texts),
            "messages": [[{"role": "user", "content": t}] for t in texts],
        },
        schema={"prompt_id": pl.String, "source": pl.String, "messages": MESSAGES},
    )


def resources(urls: list[str], root, *, fleet: dict | None = None, **settings) -> dict:
    """Resources attached to running (simulated) servers; ``fleet`` and ``settings`` override fields."""
    fast_retries = {"backoff_initial_s": 0.01, "progress_interval_s": 1.0}
    return {
        "fleet": FleetResource(mode="attach", urls=urls, **(fleet or {})),
        "settings": GenerationSettings(**{**fast_retries, **settings}),
        "storage": StorageResource(root=str(root)),
        "parquet_io": ParquetIOManager(root=str(root)),
    }


def mock_client(handler) -> HttpClient:
    """A generation client whose requests ``handler`` answers in-process (httpx's MockTransport)."""
    return make_client(timeout_s=10.0, connect_timeout_s=2.0, tls=ssl.create_default_context(),
                       transport=httpx.MockTransport(handler))
