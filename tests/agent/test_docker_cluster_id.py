"""The docker executor keeps to its own cluster id (issue 12): two clusters of one name, and a legacy
agent without an id, on one real dockerd. Each lists, adopts, recovers and destroys only its own
containers, whatever their sandbox names, and a request's labels cannot claim another cluster's id."""

from __future__ import annotations

import uuid

import pytest

from agent.executors.base import RunRequest, SandboxNotFound, SandboxSpec
from agent.executors.docker import (
    LABEL_CLUSTER,
    LABEL_CLUSTER_ID,
    DockerExecutor,
    container_kwargs,
    container_name,
    is_own,
)
from agent.executors.images import HOSTROOT_IMAGE

NOBODY = "65534:65534"


def test_labels_and_name_carry_the_cluster_id() -> None:
    spec = SandboxSpec("s1", HOSTROOT_IMAGE, 64, {LABEL_CLUSTER_ID: "feedfeedfeed"}, user=NOBODY)
    kw = container_kwargs(spec, "local", "0", HOSTROOT_IMAGE, cluster_id="0123456789ab")
    assert kw["labels"][LABEL_CLUSTER] == "local"
    assert kw["labels"][LABEL_CLUSTER_ID] == "0123456789ab"  # the request's id is not taken
    assert kw["name"] == "tangram-local-0123456789ab-s1"
    legacy = container_kwargs(spec, "local", "0", HOSTROOT_IMAGE)
    assert LABEL_CLUSTER_ID not in legacy["labels"]
    assert legacy["name"] == container_name("local", "s1") == "tangram-local-s1"


def test_is_own() -> None:
    with_id = {LABEL_CLUSTER: "local", LABEL_CLUSTER_ID: "aaa"}
    assert is_own(with_id, "local", "aaa")
    assert not is_own(with_id, "local", "bbb")
    assert not is_own(with_id, "local", "")  # an agent without an id never touches a cluster with one
    assert is_own({LABEL_CLUSTER: "local"}, "local", "")
    assert not is_own({LABEL_CLUSTER: "local"}, "local", "aaa")
    assert not is_own({LABEL_CLUSTER: "other"}, "other-name", "")


@pytest.mark.docker
async def test_two_clusters_of_one_name_keep_to_their_own(docker_client, busybox_image, test_labels) -> None:
    name = f"t{uuid.uuid4().hex[:8]}"  # one name, three clusters: two with ids, one legacy

    def executor(cluster_id: str) -> DockerExecutor:
        return DockerExecutor(docker_client, name, "0", busybox_image, mode="docker", cluster_id=cluster_id)

    a, b, old = executor("aaaaaaaaaaaa"), executor("bbbbbbbbbbbb"), executor("")
    spec = SandboxSpec("s1", busybox_image, 64, dict(test_labels), user=NOBODY)
    try:
        for ex in (a, b, old):
            await ex.create_sandbox(spec)  # the same sandbox name in each: no name clash
        for ex in (a, b, old):
            assert await ex.list_sandboxes() == ["s1"]
            assert (await ex.recover()).containers == 1  # only its own running container
        found = docker_client.containers.list(all=True, filters={"label": [f"{LABEL_CLUSTER}={name}"]})
        assert sorted(c.labels.get(LABEL_CLUSTER_ID, "") for c in found) == [
            "",
            "aaaaaaaaaaaa",
            "bbbbbbbbbbbb",
        ]

        fresh_b = executor("bbbbbbbbbbbb")  # a restarted agent of B adopts B's sandbox and runs in it
        r = await fresh_b.run(RunRequest("a-1", "s1", "echo in-b", (0,)))
        assert r.exit_code == 0 and r.stdout == b"in-b\n"
        await fresh_b.close()

        await old.destroy_sandbox("s1")
        await a.destroy_sandbox("s1")
        assert await b.list_sandboxes() == ["s1"]  # B's survives A's and the legacy agent's destroy
        assert await a.list_sandboxes() == [] and await old.list_sandboxes() == []
        with pytest.raises(SandboxNotFound):
            await executor("cccccccccccc").run(RunRequest("a-2", "s1", "true", (0,)))
    finally:
        for ex in (a, b, old):
            await ex.close()
            await ex.destroy_sandbox("s1")
