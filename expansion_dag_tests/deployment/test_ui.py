"""The Dagster UI in headless Chromium, on the `dagster dev` that ran the pipeline (the `ui_pipeline`
fixture): what a user sees. Each page is saved to test-artifacts/ui/ for a person to look at.
"""

import dataclasses
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from expansion_dag_tests.deployment.conftest import SLOW_SERVER
from expansion_dag_tests.deployment.support import ROOT, wait_for

pytestmark = pytest.mark.timeout(600)  # the first test pays for the pipeline fixture

CHROMIUM = Path("/usr/bin/chromium")
# Headless in a container as root, and no calls home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = ROOT / "test-artifacts" / "ui"
GROUPS = ["sources", "prompts", "budget", "generation", "training"]


@pytest.fixture(scope="module")
def page(ui_pipeline):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `bash .ci/system-packages` (as root) to install Debian's chromium")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(base_url=ui_pipeline.dev.url, viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(30_000)
            expect.set_options(timeout=30_000)
            yield page
        finally:
            browser.close()


def snap(page: Page, name: str) -> None:
    """Save the page once its data has arrived, with the dialogs' fade-in animations finished."""
    page.wait_for_load_state("networkidle")
    page.screenshot(path=SCREENSHOTS / f"{name}.png", animations="disabled")


def shows(label: str, name: str) -> bool:
    """A graph node shows ``name`` in full, or cut in the middle ("raw_infi…_instruct") when zoomed out."""
    head, cut, tail = label.partition("…")
    return label == name or (bool(cut) and name.startswith(head) and name.endswith(tail))


def test_the_asset_graph_shows_the_five_stages_and_every_asset(page: Page, ui_pipeline):
    data = ui_pipeline.dev.graphql("{ assetNodes { assetKey { path } groupName } }")
    assets = {node["assetKey"]["path"][-1]: node["groupName"] for node in data["assetNodes"]}
    assert sorted(set(assets.values())) == sorted(GROUPS)
    assert {"prompts", "budgeted_prompts", "shard_prompts", "completions", "training_set"} <= set(assets)

    page.goto("/asset-groups")
    graph_nodes = page.locator("svg foreignObject")
    for group in GROUPS:
        expect(graph_nodes.get_by_text(group, exact=True)).to_be_visible()
    # Groups start collapsed; the graph's settings menu expands them, as a user would.
    page.get_by_role("button", name="settings", exact=True).click()
    page.get_by_role("menuitem", name="Expand all groups").click()
    page.keyboard.press("Escape")
    expect(page.get_by_role("menu")).to_have_count(0)
    nodes = page.locator('[class*="AssetNode_minimalAssetNodeBox"]')  # zoomed out to fit: names only
    expect(nodes).to_have_count(len(assets))
    for i in range(len(assets)):
        # Green: materialized, which the pipeline did to every asset.
        expect(nodes.nth(i)).to_have_attribute("style", re.compile("background-green"))
    snap(page, "asset-graph")

    labels = nodes.all_text_contents()
    missing = [name for name in assets if not any(shows(label, name) for label in labels)]
    assert not missing, f"not in the graph: {missing}; labels: {labels}"
    expect(page.get_by_text("Join the Dagster community")).to_have_count(0)


def test_the_completions_partitions_page_shows_both_shards_materialized(page: Page):
    page.goto("/assets/completions?view=partitions")
    for shard in ("shard-00", "shard-01"):
        expect(page.get_by_text(shard, exact=True).first).to_be_visible()
    expect(page.get_by_text("Materialized (2)")).to_be_visible()
    expect(page.get_by_text("Failed (0)")).to_be_visible()
    # The shard that failed and was re-executed: its materialization and what it did.
    page.get_by_text("shard-01", exact=True).first.click()
    expect(page.get_by_text("completed_before_this_run", exact=True)).to_be_visible()
    snap(page, "completions-partitions")


def test_the_completions_checks_page_shows_each_shards_check_status(page: Page):
    """A check of completions, by partition: after the re-execution, both shards passed failure_rate."""
    page.goto("/assets/completions?view=checks")
    page.get_by_text("failure_rate", exact=True).first.click()
    expect(page.get_by_text("blocking", exact=True).first).to_be_visible()  # "This is a blocking asset check."
    page.get_by_role("tab", name="Partitions").last.click()  # the check's own tab, not the asset's
    for shard in ("shard-00", "shard-01"):
        expect(page.get_by_text(shard, exact=True).first).to_be_visible()
    expect(page.get_by_text("Passed (2)", exact=True)).to_be_visible()
    expect(page.get_by_text("Failed (0)", exact=True)).to_be_visible()
    snap(page, "completions-failure-rate-by-partition")


def test_the_jobs_and_automation_pages_list_the_jobs_schedules_and_sensors(page: Page, ui_pipeline):
    page.goto("/jobs")
    for job in ("prepare_job", "generate_job", "training_set_job"):
        expect(page.get_by_role("link", name=job)).to_be_visible()
    snap(page, "jobs")

    data = ui_pipeline.dev.graphql(
        "query($s: RepositorySelector!) { repositoryOrError(repositorySelector: $s) { ... on Repository { "
        "schedules { name } sensors { name } } } }",
        s={"repositoryLocationName": "expansion_dag", "repositoryName": "__repository__"},
    )
    repository = data["repositoryOrError"]
    assert repository["schedules"], "the code location defines no schedule"
    page.goto("/automation")
    # Each row, once loaded, says what kind of automation it is.
    for schedule in repository["schedules"]:
        expect(page.get_by_role("link", name=schedule["name"])).to_contain_text("Scheduled")
    for sensor in repository["sensors"]:
        expect(page.get_by_role("link", name=sensor["name"])).to_contain_text("sensor")
    snap(page, "automation")


def test_the_training_set_summary_shows_its_histogram_as_an_image(page: Page):
    page.goto("/assets/training_set")
    summary = page.locator("tr", has=page.get_by_text("summary", exact=True))
    summary.get_by_text("[Show Markdown]").click()
    dialog = page.get_by_role("dialog")
    image = dialog.locator('img[src^="data:image/png;base64,"]')
    expect(image).to_be_visible()
    assert image.evaluate("img => img.complete && img.naturalWidth") > 0  # decoded, not a broken icon
    snap(page, "training-set-summary")


def test_a_running_shard_shows_its_progress(page: Page, ui_pipeline):
    """Last in this file: it slows shard-00's server and ends with a terminated run."""
    dev, fleet = ui_pipeline.dev, ui_pipeline.fleet
    # A slower server (seconds a request) and another temperature (a new identity: every prompt is
    # sent again, in the same store): the shard runs for a while.
    fleet.restart(0, config=dataclasses.replace(SLOW_SERVER, token_latency_s=0.1))
    settings = {"temperature": 0.5, "progress_interval_s": 1.0, "spill_to_idle_servers": False}
    run_config = {"execution": {"config": {"in_process": {}}}, "resources": {"settings": {"config": settings}}}
    run_id = dev.launch_run("generate_job", run_config, partition="shard-00")

    def progress_of_this_run():
        status = dev.run_status(run_id)
        assert status in ("QUEUED", "NOT_STARTED", "STARTING", "STARTED"), f"the run ended {status}:\n{dev.log_tail()}"
        observed = dev.latest_observation("completions", "shard-00")
        # Some answers in, most still to come.
        return observed[1] if observed and observed[0] == run_id and 0 < observed[1]["done"] < 80 else None

    try:
        figures = wait_for("the shard's progress to be reported", progress_of_this_run, 180)
        assert figures["total"] > figures["done"] and figures["requests_per_s"] > 0 and figures["eta_s"] > 0
        page.goto(f"/runs/{run_id}")
        # The run's event log shows the shard's figures as they come: done, total, rate, ETA.
        for label in ("done", "total", "requests_per_s", "eta_s", "retries"):
            expect(page.get_by_text(label, exact=True).first).to_be_visible()
        expect(page.get_by_text(str(figures["total"]), exact=True).first).to_be_visible()
        snap(page, "shard-progress-while-running")
        assert dev.run_status(run_id) == "STARTED"  # the screenshot shows a run in progress
    finally:
        dev.terminate(run_id)
        wait_for("the run to end", lambda: dev.run_status(run_id) in ("CANCELED", "FAILURE", "SUCCESS"), 120)
        fleet.restart(0, config=SLOW_SERVER)
