"""The training set published whole (issue 45): each build a new version beside the others, a
pointer switched last (a symlink on a local root, ``training_set.json`` on S3), old versions kept
up to a count, and nothing a live builder owns removed. The same faults under a crash and a reader
are in expansion_dag_tests/faults/test_publish_faults.py."""

import json
import os

import pyarrow.parquet as pq
import pytest

from expansion_dag.core import as_upath, load_tokenizer
from expansion_dag.store import BuildClaim
from expansion_dag.training import (
    POINTER,
    VERSIONS,
    Manifest,
    build_training_set,
    current_version,
    data_files,
    publishing,
)
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S, default_training, one_mode
from expansion_dag_tests.store.test_lease import Said
from expansion_dag_tests.store.test_object_storage import objects
from expansion_dag_tests.training.test_training_set import MODEL, record

#: Two rows a Parquet file: a set of a few rows is several files, as a real one is.
CONFIG = default_training(formats=("parquet", "specforge-conversations"), rows_per_file=2, chunk_rows=2)


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return as_upath(str(tmp_path / "storage"))
    return as_upath(f"s3://{request.getfixturevalue('bucket')}/storage")


def published(root, qwen3, ids, tmp_path, *, claim, keep=2, log=None):
    """A build of the records ``ids``, published as a new version; the version."""
    with publishing(root, claim=claim, keep=keep, scratch=tmp_path / "scratch", log=log or Said()) as version:
        build_training_set([record(i) for i in ids], qwen3, CONFIG, version.directory, identities=one_mode(MODEL))
    return version


def read_set(set_path) -> tuple[list[str], int]:
    """What a reader of the set gets: its rows' ids, read through the files its manifest names, and
    its manifest's count."""
    version = current_version(set_path)
    ids = []
    for url in data_files(version):
        with as_upath(url).open("rb") as fh:
            ids += pq.read_table(fh, columns=["id"])["id"].to_pylist()
    return ids, Manifest.read(version).samples


def ids_of(numbers) -> list[str]:
    return [f"p{i:04d}" for i in numbers]


def test_each_build_publishes_a_new_version_and_the_set_names_the_newest_whole(root, qwen3, tmp_path):
    said = Said()
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="run", log=said, local_dir=tmp_path / "machine") as claim:
        versions = [published(root, qwen3, range(n), tmp_path, claim=claim, log=said) for n in (3, 5, 7)]
    # The set is the newest version, whole: its rows, its manifest, its files in its own folder.
    assert read_set(root / "training_set") == (ids_of(range(7)), 7)
    assert current_version(root / "training_set") == versions[-1].url
    assert all(url.startswith(f"{versions[-1].url}/part-") for url in data_files(root / "training_set"))
    assert len(data_files(root / "training_set")) == 4
    # Two versions kept (the current one included); the oldest removed, and said.
    kept = sorted(v.url.name for v in versions[1:])
    if root.protocol == "":
        assert sorted(os.listdir(root.path + f"/{VERSIONS}")) == kept
        # The path a trainer reads names the newest version, as the link says.
        link = tmp_path / "storage" / "training_set"
        assert os.readlink(link) == f"{VERSIONS}/{versions[-1].name}"
        assert sorted(p.name for p in link.glob("part-*.parquet")) == [f"part-{i:05d}.parquet" for i in range(4)]
    else:
        stored = objects(str(root))
        assert sorted({o.split("/")[1] for o in stored if o.startswith(f"{VERSIONS}/")}) == kept
        assert json.loads((root / POINTER).read_text()) == {"version": versions[-1].name,
                                                            "path": f"{VERSIONS}/{versions[-1].name}"}
        assert not [o for o in stored if o.startswith("training_set/")]
    assert said.saying(f"removed the training set version {versions[0].url}")
    assert read_set(versions[1].url) == (ids_of(range(5)), 5)  # an older version, whole


def test_a_version_finished_after_a_newer_one_never_becomes_current(root, qwen3, tmp_path):
    said = Said()
    with (BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="nightly", log=said, local_dir=tmp_path / "a") as early,
          BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="manual", log=said, local_dir=tmp_path / "b") as late):
        with publishing(root, claim=early, keep=3, scratch=tmp_path / "scratch", log=said) as slow:
            build_training_set([record(i) for i in range(2)], qwen3, CONFIG, slow.directory, identities=one_mode(MODEL))
            fast = published(root, qwen3, range(4), tmp_path, claim=late, keep=3, log=said)
    assert (fast.current, slow.current) == (True, False)
    assert read_set(root / "training_set") == (ids_of(range(4)), 4)
    assert read_set(slow.url) == (ids_of(range(2)), 2)  # kept whole, as an older version
    assert said.saying(f"a newer version of the training set was published while {slow.name} was built")


def test_a_version_a_live_builder_owns_is_never_removed(root, qwen3, tmp_path):
    """Builder A, on another host, is still writing its version when B publishes, keeping one."""
    said = Said()
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="a", log=said, local_dir=tmp_path / "host-a") as a:
        unfinished = root / VERSIONS / f"20260101T000000000000Z-{a.id}"  # started first, not published
        if root.protocol == "":
            os.makedirs(unfinished.path)
        (unfinished / "part-00000.parquet").write_bytes(b"the first file of a set being written")
        with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="b", log=said, local_dir=tmp_path / "host-b") as b:
            published(root, qwen3, range(3), tmp_path, claim=b, keep=1, log=said)
        assert (unfinished / "part-00000.parquet").exists()
    # A ended without publishing: its claim is gone, and the next build removes what it left.
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="c", log=said, local_dir=tmp_path / "host-b") as c:
        newest = published(root, qwen3, range(4), tmp_path, claim=c, keep=1, log=said)
    names = ({p.name for p in (root / VERSIONS).iterdir()} if root.protocol == ""
             else {o.split("/")[1] for o in objects(str(root)) if o.startswith(f"{VERSIONS}/")})
    assert names == {newest.name}
    assert read_set(root / "training_set") == (ids_of(range(4)), 4)
