"""The Kubernetes configuration in deploy/k8s loads and validates, offline.

What is checked, through Dagster's public API only: the instance file loaded as an instance (its
storage aside, which would connect) and each configured class's section against that class's own
schema (the K8sRunLauncher, the PostgreSQL storage, the queued run coordinator), validated as run
configuration; the run pods the launcher would create, built with dagster-k8s's own job builder
(generation runs with the GPU tag, other runs without); the Helm values against the chart keys they
use. No cluster, database or registry is contacted: a Kubernetes client is configured from a dummy
kubeconfig and never called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import kubernetes
import pytest
import sqlalchemy as sa
import yaml
from dagster_k8s import K8sRunLauncher
from dagster_k8s.job import (
    UserDefinedDagsterK8sConfig,
    construct_dagster_k8s_job,
    get_user_defined_k8s_config,
)
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import pg_url_from_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_CONFIG_TAG = "dagster-k8s/config"

PG_ENV = {
    "DAGSTER_PG_USER": "dagster",
    "DAGSTER_PG_PASSWORD": "not-a-secret",
    "DAGSTER_PG_HOST": "postgres.test",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_PG_PORT": "5432",
}

#: A kubeconfig that is parsed, never used: the client never sends a request in these tests.
DUMMY_KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
    "users": [{"name": "none", "user": {"token": "unused"}}],
    "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
    "current-context": "none",
}


def load(name: str) -> Any:
    return yaml.safe_load((K8S / name).read_text())


def validated(config_class: Any, section: dict[str, Any]) -> dict[str, Any]:
    """``section`` as Dagster reads it for ``config_class`` (defaults filled in, variables read), by the
    class's own schema; a mistake raises ``DagsterInvalidConfigError`` naming it. An instance loads
    each class's section by that schema: here it is the config of an op, validated as run config."""

    @dg.op(config_schema=config_class.config_type())
    def section_of():
        pass

    @dg.job
    def validate():
        section_of()

    return dg.validate_run_config(validate, {"ops": {"section_of": {"config": section}}})["ops"]["section_of"]["config"]


def dummy_kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(DUMMY_KUBECONFIG))
    return str(path)


def offline(run_launcher: dict[str, Any], kubeconfig: str) -> dict[str, Any]:
    """The launcher's section, reading the dummy kubeconfig instead of the in-cluster one."""
    return {**run_launcher, "config": {**run_launcher["config"], "load_incluster_config": False,
                                       "kubeconfig_file": kubeconfig}}


def generate_run_tags() -> dict[str, str]:
    """The tags as the code location would attach them: every value a JSON string."""
    return {key: json.dumps(value) for key, value in load("gpu-run-tags.yaml").items()}


@pytest.fixture
def pg_env(monkeypatch):
    for key, value in PG_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def launcher(tmp_path, pg_env) -> K8sRunLauncher:
    """The run launcher built from deploy/k8s/dagster.yaml as the instance builds it (its section
    read by its schema, then the class made from it), except that the Kubernetes client reads a
    dummy kubeconfig instead of the in-cluster one."""
    section = offline(load("dagster.yaml")["run_launcher"], dummy_kubeconfig(tmp_path))
    assert (section["module"], section["class"]) == ("dagster_k8s", "K8sRunLauncher")
    return K8sRunLauncher(**validated(K8sRunLauncher, section["config"]))


def run_pod(launcher: K8sRunLauncher, job_name: str, tags: dict[str, str]) -> dict[str, Any]:
    """The pod spec of the Kubernetes Job the launcher would create for a run with these tags."""
    run = dg.DagsterRun(job_name=job_name, run_id="0" * 8 + "-0000-0000-0000-" + "0" * 12, tags=tags)
    context = launcher.get_container_context_for_run(run)
    job = construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(job_image="registry.example.com/expansion-dag:0.1.0",
                                              run_launcher=launcher),
        args=["dagster", "api", "execute_run", "{}"],
        job_name=f"dagster-run-{run.run_id}",
        user_defined_k8s_config=context.run_k8s_config,
        component="run_worker",
    )
    manifest = kubernetes.client.ApiClient().sanitize_for_serialization(job)
    return {"namespace": context.namespace, **manifest["spec"]["template"]["spec"]}


# --- deploy/k8s/dagster.yaml ----------------------------------------------------------------------


def test_the_instance_file_loads_as_an_instance(tmp_path, pg_env):
    # Every section but the storage, which would connect to its database (checked by its own
    # schema below): a key the instance schema lacks, or a section of the wrong shape, fails here.
    config = {key: value for key, value in load("dagster.yaml").items() if key != "storage"}
    config["run_launcher"] = offline(config["run_launcher"], dummy_kubeconfig(tmp_path))
    with dg.instance_for_test(overrides=config) as instance:
        assert instance.get_run_records() == []
    with pytest.raises(dg.DagsterInvalidConfigError, match='unexpected config entry "telemetri"'):
        with dg.instance_for_test(overrides={**config, "telemetri": {"enabled": False}}):
            pass
    assert load("dagster.yaml")["telemetry"] == {"enabled": False}


def test_the_instance_keeps_the_projects_run_concurrency_block():
    # The local instance's rule (never two runs on one shard) must hold on the cluster too.
    local = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    assert load("dagster.yaml")["concurrency"] == local["concurrency"]
    limits = load("dagster.yaml")["concurrency"]["runs"]["tag_concurrency_limits"]
    assert {"key": "dagster/partition", "limit": 1, "value": {"applyLimitPerUniqueValue": True}} in limits


def test_the_run_launcher_config_passes_the_k8s_run_launchers_own_schema(pg_env):
    value = validated(K8sRunLauncher, load("dagster.yaml")["run_launcher"]["config"])
    assert value["instance_config_map"] == "dagster-instance"
    assert value["job_namespace"] == "expansion-dag"
    assert value["image_pull_policy"] == "IfNotPresent"
    assert value["service_account_name"] == "dagster"
    assert value["env_secrets"] == ["expansion-dag-secrets"]
    assert value["load_incluster_config"] is True  # on the cluster, the pod's service account
    with pytest.raises(dg.DagsterInvalidConfigError, match='unexpected config entry "job_namspace"'):
        validated(K8sRunLauncher, {**load("dagster.yaml")["run_launcher"]["config"], "job_namspace": "x"})


def test_storage_is_postgres_through_psycopg2_from_environment_variables(pg_env):
    storage = load("dagster.yaml")["storage"]
    assert set(storage) == {"postgres"}  # run, event log and schedule storage, all in dagster_postgres
    url = pg_url_from_config(validated(DagsterPostgresStorage, storage["postgres"]))
    assert url.startswith("postgresql+psycopg2://dagster:not-a-secret@postgres.test:5432/dagster")
    # SQLAlchemy resolves the driver without connecting: psycopg2, which dagster-postgres installs.
    assert sa.create_engine(url).dialect.driver == "psycopg2"


# --- the GPU request: gpu-run-tags.yaml through the launcher -----------------------------------


def test_the_gpu_tag_is_a_valid_dagster_k8s_config():
    raw = load("gpu-run-tags.yaml")
    assert set(raw) == {K8S_CONFIG_TAG}
    UserDefinedDagsterK8sConfig.from_dict(raw[K8S_CONFIG_TAG])  # raises on keys Kubernetes lacks
    parsed = get_user_defined_k8s_config(generate_run_tags())  # what the launcher does with the tag
    assert parsed.container_config["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_a_generation_run_with_the_tag_gets_one_gpu_on_top_of_the_launcher_defaults(launcher):
    pod = run_pod(launcher, "generate_job", {"dagster/partition": "shard-03", **generate_run_tags()})
    assert pod["namespace"] == "expansion-dag"
    assert pod["serviceAccountName"] == "dagster"
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["memory"] == "48Gi"  # the tag wins over the default
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # The launcher's defaults are still there: the secrets (DAGSTER_PG_* rebuild the instance in
    # the pod) and the EXPANSION_* settings.
    assert {"secretRef": {"name": "expansion-dag-secrets"}} in container["envFrom"]
    assert {"configMapRef": {"name": "expansion-dag-env"}} in container["envFrom"]


@pytest.mark.parametrize("job_name", ["prepare_job", "training_set_job", "generate_job"])
def test_runs_without_the_tag_request_no_gpu(launcher, job_name):
    # prepare/training runs, and shard runs in attach mode (the SGLang deployments hold the GPUs).
    tags = {"dagster/partition": "shard-00"} if job_name == "generate_job" else {}
    (container,) = run_pod(launcher, job_name, tags)["containers"]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    assert {"secretRef": {"name": "expansion-dag-secrets"}} in container["envFrom"]
    assert {"configMapRef": {"name": "expansion-dag-env"}} in container["envFrom"]


# --- deploy/k8s/values.yaml -------------------------------------------------------------------------

#: The chart keys these values may use, from the chart's values.schema.json (dagster-io/dagster,
#: helm/dagster, commit bdb8547f). A key outside these is a typo the chart would ignore or refuse.
CHART_KEYS: dict[str, set[str]] = {
    "": {"dagster-user-deployments", "runLauncher", "postgresql", "generatePostgresqlPasswordSecret", "global",
         "dagsterDaemon", "telemetry", "dagsterWebserver", "computeLogManager", "imagePullSecrets",
         "serviceAccount", "pythonLogs", "retention", "ingress", "scheduler", "migrate", "busybox"},
    "dagster-user-deployments": {"enabled", "enableSubchart", "imagePullSecrets", "deployments"},
    "deployment": {"name", "image", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns",
                   "deploymentNamespace", "port", "env", "envConfigMaps", "envSecrets", "annotations",
                   "nodeSelector", "affinity", "tolerations", "podSecurityContext", "securityContext",
                   "resources", "livenessProbe", "readinessProbe", "startupProbe", "labels", "volumeMounts",
                   "volumes", "schedulerName", "initContainers", "sidecarContainers"},
    "image": {"repository", "tag", "pullPolicy"},
    "runLauncher": {"type", "config"},
    "k8sRunLauncher": {"image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile",
                       "envConfigMaps", "envSecrets", "envVars", "volumeMounts", "volumes", "labels",
                       "failPodOnRunFailure", "resources", "schedulerName", "securityContext", "runK8sConfig"},
    "postgresql": {"image", "enabled", "postgresqlHost", "postgresqlUsername", "postgresqlPassword",
                   "postgresqlDatabase", "postgresqlParams", "postgresqlScheme", "service"},
    "global": {"postgresqlSecretName", "dagsterHome", "serviceAccountName", "celeryConfigSecretName"},
    "dagsterDaemon": {"enabled", "image", "runCoordinator", "heartbeatTolerance", "env", "envConfigMaps",
                      "envSecrets", "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations",
                      "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe",
                      "startupProbe", "annotations", "runMonitoring", "runRetries", "sensors", "schedules",
                      "schedulerName", "volumeMounts", "volumes", "initContainerResources"},
    "runCoordinator": {"enabled", "type", "config"},
    "queuedRunCoordinator": {"maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds",
                             "dequeueNumWorkers", "dequeueUseThreads", "blockOpConcurrencyLimitedRuns"},
    "tagConcurrencyLimit": {"key", "value", "limit"},
    "telemetry": {"enabled"},
}


@pytest.fixture
def values() -> dict[str, Any]:
    return load("values.yaml")


def test_helm_values_use_only_keys_the_chart_has(values):
    def within(section: str, mapping: dict[str, Any]) -> None:
        assert set(mapping) <= CHART_KEYS[section], f"{section or 'top level'}: {set(mapping) - CHART_KEYS[section]}"

    within("", values)
    users = values["dagster-user-deployments"]
    within("dagster-user-deployments", users)
    for deployment in users["deployments"]:
        within("deployment", deployment)
        within("image", deployment["image"])
    within("runLauncher", values["runLauncher"])
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert set(values["runLauncher"]["config"]) == {"k8sRunLauncher"}
    within("k8sRunLauncher", values["runLauncher"]["config"]["k8sRunLauncher"])
    within("postgresql", values["postgresql"])
    within("global", values["global"])
    within("dagsterDaemon", values["dagsterDaemon"])
    coordinator = values["dagsterDaemon"]["runCoordinator"]
    within("runCoordinator", coordinator)
    assert set(coordinator["config"]) == {"queuedRunCoordinator"}
    within("queuedRunCoordinator", coordinator["config"]["queuedRunCoordinator"])
    for limit in coordinator["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"]:
        within("tagConcurrencyLimit", limit)
    within("telemetry", values["telemetry"])


def test_helm_values_serve_this_code_location(values):
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert values["dagster-user-deployments"]["enabled"] is True
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "expansion_dag.definitions"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'module_name = "expansion_dag.definitions"' in pyproject
    assert (ROOT / "expansion_dag" / "definitions.py").is_file()
    # Run pods must load the code location with the code server's settings.
    assert deployment["includeConfigInLaunchedRuns"] == {"enabled": True}
    assert "resources" not in deployment  # they would be copied into every run pod


def test_helm_values_set_the_production_environment(values):
    env = values["dagster-user-deployments"]["deployments"][0]["env"]
    assert {"EXPANSION_PROFILE", "EXPANSION_SHARDS", "EXPANSION_FLEET_URLS", "EXPANSION_STORAGE",
            "EXPANSION_CATALOG", "EXPANSION_TOKENIZER"} <= set(env)
    # The chart writes env into a ConfigMap, whose values Kubernetes accepts only as strings.
    assert all(isinstance(v, str) for v in env.values()), env
    assert env["EXPANSION_PROFILE"] == "production"
    assert env["EXPANSION_CATALOG"] == "production"
    assert env["EXPANSION_STORAGE"].startswith("s3://")
    # Attach mode: one server URL per shard, in shard order.
    urls = env["EXPANSION_FLEET_URLS"].split(",")
    assert len(urls) == int(env["EXPANSION_SHARDS"]) == 8
    assert len(set(urls)) == len(urls)


def test_helm_values_use_an_external_postgres_through_psycopg2(values):
    pg = values["postgresql"]
    assert pg["enabled"] is False
    assert pg["postgresqlScheme"] == load("dagster.yaml")["storage"]["postgres"]["postgres_db"]["scheme"]
    assert values["generatePostgresqlPasswordSecret"] is False
    assert values["global"]["postgresqlSecretName"]


def test_helm_values_queue_runs_with_the_projects_concurrency_limits(values):
    daemon = values["dagsterDaemon"]
    assert daemon["enabled"] is True
    coordinator = daemon["runCoordinator"]
    assert coordinator["enabled"] is True and coordinator["type"] == "QueuedRunCoordinator"
    queued = coordinator["config"]["queuedRunCoordinator"]
    # What the chart renders into the instance's run_coordinator config:
    rendered = {"max_concurrent_runs": queued["maxConcurrentRuns"],
                "tag_concurrency_limits": queued["tagConcurrencyLimits"]}
    validated(dg.QueuedRunCoordinator, rendered)
    local = yaml.safe_load((ROOT / "dagster.yaml").read_text())["concurrency"]["runs"]
    assert rendered["max_concurrent_runs"] == local["max_concurrent_runs"]
    assert rendered["tag_concurrency_limits"] == local["tag_concurrency_limits"]


def test_helm_values_launch_cpu_only_run_pods_and_keep_telemetry_off(values):
    # GPU requests belong to generate_job's tag (launch mode) or to the SGLang deployments.
    assert "nvidia.com/gpu" not in json.dumps(values)
    launcher_values = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert launcher_values["envSecrets"] == [{"name": "expansion-dag-secrets"}]
    assert values["telemetry"] == {"enabled": False}
