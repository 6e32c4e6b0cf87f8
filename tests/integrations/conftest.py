"""One real local cluster (`tangram up --executor process`, TANGRAM_HOME in a temporary directory)
for the adapter tests; the client finds it through TANGRAM_HOME, as rollout code would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cli import CLUSTER_VARS, local_cluster


@pytest.fixture(scope="package")
def cluster_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("integrations") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANGRAM_HOME", str(home))
        for var in CLUSTER_VARS:
            mp.delenv(var, raising=False)
        with local_cluster(home, "--gpus", "1"):
            yield home
