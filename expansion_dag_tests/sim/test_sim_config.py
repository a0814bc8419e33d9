import httpx
import pytest

from expansion_dag.sim import SimServerConfig, SimulatedFleet


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("host", "", "host must not be empty"),
        ("port", 70000, "port must be in 0..65535, got 70000"),
        ("model_path", "", "model_path must not be empty"),
        ("served_model_name", "", "served_model_name must be None or non-empty"),
        ("context_length", 1, "context_length must be >= 2, got 1"),
        ("max_running_requests", 0, "max_running_requests must be >= 1, got 0"),
        ("max_queued_requests", -1, "max_queued_requests must be None or >= 0, got -1"),
        ("api_key", "", "api_key must be None or non-empty"),
        (
            "reasoning_parser",
            "deepseek-r1",
            "reasoning_parser must be None or one of ('qwen3',), got 'deepseek-r1'",
        ),
        ("backend", "tgi", "backend must be one of ('sglang', 'vllm'), got 'tgi'"),
        ("startup_delay_s", -1.0, "startup_delay_s must be a finite number >= 0, got -1.0"),
        ("warmup_s", float("nan"), "warmup_s must be a finite number >= 0, got nan"),
        ("ttft_s", -0.1, "ttft_s must be a finite number >= 0, got -0.1"),
        ("token_latency_s", float("inf"), "token_latency_s must be a finite number >= 0, got inf"),
        ("output_sigma", -1.0, "output_sigma must be a finite number >= 0, got -1.0"),
        ("output_median_tokens", 0, "output_median_tokens must be >= 1, got 0"),
        ("reasoning_share", 1.0, "reasoning_share must be strictly between 0 and 1, got 1.0"),
        ("fail_rate", 1.5, "fail_rate must be in [0, 1], got 1.5"),
        ("hang_rate", -0.5, "hang_rate must be in [0, 1], got -0.5"),
        ("fail_status", 200, "fail_status must be an HTTP error status (400..599), got 200"),
        ("die_after_requests", 0, "die_after_requests must be None or >= 1, got 0"),
        ("abort_rate", 2.0, "abort_rate must be in [0, 1], got 2.0"),
        ("max_total_tokens", 7, "max_total_tokens must be None or >= 8, got 7"),
        ("version", "0.5.3", "version must be None or an SGLang version from 0.5.4 to 0.5.23, got '0.5.3'"),
        ("version", "latest", "version must be None or an SGLang version from 0.5.4 to 0.5.23, got 'latest'"),
    ],
)
def test_each_invalid_field_is_named_in_the_error(field, value, message):
    with pytest.raises(ValueError) as raised:
        SimServerConfig(**{field: value})
    assert str(raised.value) == f"invalid simulator config: {message}"


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError, match=r"context_length.*; fail_rate"):
        SimServerConfig(context_length=0, fail_rate=2.0)


def test_defaults_and_served_name():
    config = SimServerConfig()
    assert (config.host, config.port, config.context_length, config.max_running_requests) == (
        "127.0.0.1",
        30000,
        8192,
        16,
    )
    assert config.model_name == "Qwen/Qwen3-8B"
    assert SimServerConfig(served_model_name="qwen").model_name == "qwen"


def test_api_key_stays_out_of_repr():
    assert "hunter2" not in repr(SimServerConfig(api_key="hunter2"))


def test_config_is_frozen_and_keyword_only():
    config = SimServerConfig()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SimServerConfig("0.0.0.0")  # type: ignore[misc]


def test_vllm_is_emulated_at_one_version_only():
    with pytest.raises(ValueError, match="version must be None or '0.33.0' for backend 'vllm', got '0.32.0'"):
        SimServerConfig(backend="vllm", version="0.32.0")
    assert SimServerConfig(backend="vllm").server_version == "0.33.0"


def test_max_req_input_len_is_sglangs_own_formula():
    # min(context - 1, kv capacity - 1) - 5, the capacity defaulting to slots x context
    assert SimServerConfig(context_length=4096, max_running_requests=8).max_req_input_len == 4090
    assert SimServerConfig(context_length=4096, max_total_tokens=1000).max_req_input_len == 994


def test_a_release_candidate_is_emulated_as_what_came_before_its_release(fast):
    # pip's order (packaging.version): 0.5.8rc1 is after 0.5.7 and before 0.5.8, whose /v1/loads it lacks.
    with pytest.raises(ValueError, match="got '0.5.4rc1'"):
        SimServerConfig(version="0.5.4rc1")  # before the oldest emulated
    with SimulatedFleet([fast(version="0.5.8rc1"), fast(version="0.5.8")]) as fleet:
        assert [httpx.get(f"{url}/v1/loads").status_code for url in fleet.urls] == [404, 200]
        assert [httpx.get(f"{url}/get_load").status_code for url in fleet.urls] == [200, 200]
