"""One real local cluster (`tangram up --executor process`, TANGRAM_HOME in a temporary directory)
for the adapter tests; the client finds it through TANGRAM_HOME, as rollout code would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import tangram


@pytest.fixture(scope="package")
def cluster_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("integrations") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANGRAM_HOME", str(home))
        for var in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_CERTS"):
            mp.delenv(var, raising=False)
        up = tangram("up", "--executor", "process", "--gpus", "1", home=home, timeout=90)
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            yield home
        finally:
            down = tangram("down", home=home, timeout=60)
            assert down.returncode == 0, down.stdout + down.stderr
