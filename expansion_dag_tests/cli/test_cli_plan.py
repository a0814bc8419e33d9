"""`expansion-dag plan`: what a run will send, cost and yield, printed before any GPU time; what cannot
be planned is said, and the rest still printed."""

import subprocess

import yaml

from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.cli.test_cli import EXPANSION_DAG, clean_env
from expansion_dag_tests.ports import free_port

SOURCES = ("agentinstruct", "codefeedback", "hermes_fc", "infinity_instruct", "metamathqa", "webinstructsub")


def plan(tmp_path, document: dict) -> subprocess.CompletedProcess:
    config = tmp_path / "my-run.yaml"
    config.write_text(yaml.safe_dump(document))
    return subprocess.run([EXPANSION_DAG, "plan", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=540)


def test_the_plan_of_an_attached_fleet_prints_prompts_tokens_cut_share_disk_and_time(tmp_path):
    idle = SimServerConfig(port=0, max_running_requests=8)
    with SimulatedFleet([idle, idle]) as fleet:
        result = plan(tmp_path, {"fleet": {"mode": "attach", "urls": fleet.urls},
                                 "generation": {"plan_output_tokens_per_s": 2500.0, "max_output_tokens": 512}})
        sent = [fleet.stats(i)["chat_requests_by_status"] for i in range(2)]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert sent == [{"200": 1}, {"200": 1}]  # the budget's weights probe, one a server: no prompt generated
    assert "plan: 188 prompts to send (0 already answered)" in out
    for source in SOURCES:
        assert f"  {source}: " in out
    # The bundled estimate is 1,024 tokens an answer; a cap of 512 cuts about a third of them.
    assert "[configured: 1,024 tokens, spread assumed]" in out and "% cut at the cap" in out
    assert "  disk: store +" in out
    assert "wall on 2 server(s) at 2,500 output tokens/s each [setting: generation.plan_output_tokens_per_s; decode only]" in out


def test_a_plan_with_a_throughput_of_0_says_so_and_prints_the_rest(tmp_path):
    result = plan(tmp_path, {"fleet": {"launch": {"base_port": free_port(2)}},
                             "generation": {"plan_output_tokens_per_s": 0.0}})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "cannot plan: a throughput of 0 output tokens/s (setting: generation.plan_output_tokens_per_s)" in result.stdout
    assert "plan: 188 prompts to send" in result.stdout and "  disk: store +" in result.stdout


def test_a_plan_for_a_fleet_nobody_answers_names_it_and_prints_the_prompts_by_source(tmp_path):
    nobody = f"http://127.0.0.1:{free_port(1)}"
    result = plan(tmp_path, {"fleet": {"mode": "attach", "urls": [nobody, nobody]}})
    assert result.returncode == 1
    assert "plan: prompts by source after dedup and quotas: {" in result.stdout
    assert "plan: incomplete, the prepare run failed: the fleet: no server of the fleet answers" in result.stdout
    assert nobody in result.stdout


def test_a_gate_setting_out_of_range_is_refused_naming_the_field(tmp_path):
    result = plan(tmp_path, {"generation": {"min_yield": 1.5}})
    assert result.returncode == 2
    assert "generation.min_yield" in result.stderr and "my-run.yaml" in result.stderr
