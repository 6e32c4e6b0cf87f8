"""Every example runs as written against `tangram up` (issue 12).

One real local cluster (`tangram up`: a detached controller and agent on 127.0.0.1, TANGRAM_HOME in a
temporary directory, the process executor so no shared dockerd is touched) serves the module. Each
script in `examples/` runs as a subprocess with small arguments, as its docstring says to run it (the
client finds the cluster through TANGRAM_HOME, no TANGRAM_ADDR), and must exit 0 and print its result;
every ```python block of README.md and docs/client.md runs the same way, as a script. A new example
without an entry in EXAMPLES fails `test_every_example_has_a_run`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cli import clean_env, local_cluster

from tangram_cli.controller.config import load_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "examples"
DOCS_WITH_CODE = ("README.md", "docs/client.md")
SCRIPT_TIMEOUT_S = 60

# script -> (arguments, patterns its stdout must match)
EXAMPLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "coding_rollout.py": (
        ("--trajectories", "2", "--turns", "1"),
        (
            r"trajectory 0: ACT [0-9.]+s, test run [0-9.]+s on [12] cores",
            r"trajectory 1: ",
            r"mean ACT [0-9.]+s",
        ),
    ),
    "reward_call.py": (
        (),
        (
            r"'the cat sat on the mat' +score 0\.833  node local",
            r"'42' +score 0\.400",
            r"'no idea' +score 0\.000",
        ),
    ),
    "verl_tool.py": (
        (),
        (
            r"verl base: (verl|fallback), tool 'bash'",
            r"reward before the fix: 0\.25",
            r"1 passed, 3 failed \(workers=1\)\n  \[exit code 1\]",
            r"reward after the fix: 1\.00 \(test run on [12] cores",
            r"\nreleased\n",
        ),
    ),
    "skyrl_env.py": (
        (),
        (
            r"skyrl-gym base: (skyrl_gym|fallback)",
            r"turn 2: 1 passed, 3 failed \(workers=1\)\n  \[exit code 1\]",
            r"done after 4 turns: reward 1\.00, test run on [12] cores",
            r"\nclosed\n",
        ),
    ),
}


def run_script(path: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        env=clean_env(home),
        cwd=path.parent,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert r.returncode == 0, f"{path.name} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TANGRAM_HOME of a running local cluster (`tangram up`), brought down at the end."""
    home = tmp_path_factory.mktemp("examples") / "home"
    with local_cluster(home, "--gpus", "2", "--gpu-mem", "16GiB"):
        yield home


def test_every_example_has_a_run() -> None:
    scripts = {p.name for p in EXAMPLES_DIR.glob("*.py") if not p.name.startswith("_")}  # _x.py: shared parts
    assert scripts == set(EXAMPLES), "add each script of examples/ to EXAMPLES (and drop removed ones)"
    shared = {p.name for p in EXAMPLES_DIR.glob("_*.py")}
    found = {p.name for p in EXAMPLES_DIR.iterdir()} - {"__pycache__"}
    assert found == scripts | shared | {"local-cluster.json"}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_against_tangram_up(home: Path, script: str) -> None:
    args, patterns = EXAMPLES[script]
    r = run_script(EXAMPLES_DIR / script, *args, home=home)
    for pattern in patterns:
        assert re.search(pattern, r.stdout), f"{script}: no match for {pattern!r} in:\n{r.stdout}"


@pytest.mark.parametrize("doc", DOCS_WITH_CODE)
def test_doc_python_blocks_run_as_scripts(home: Path, tmp_path: Path, doc: str) -> None:
    blocks = python_blocks(doc)
    assert blocks, f"{doc}: no ```python block found"
    outputs = []
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        outputs.append(run_script(script, home=home).stdout)
    if doc == "README.md":  # its one snippet prints what the sandbox computed and the reward
        assert len(outputs) == 1
        assert re.fullmatch(r"42 on [12] cores \| reward 0\.[0-9]+\n", outputs[0]), outputs[0]


def test_local_cluster_json_is_a_controller_config() -> None:
    """`examples/local-cluster.json` is what `tangram controller --config` reads (docs/client.md), and
    has what the examples use: the `reward` GPU service and the `search` API."""
    path = EXAMPLES_DIR / "local-cluster.json"
    raw = json.loads(path.read_text())
    config = load_config(str(path))
    assert config.cluster == raw["cluster"]
    assert config.service("reward") is not None
    assert [a.name for a in config.apis] == ["search"]
    assert "examples/local-cluster.json" in (ROOT / "docs" / "client.md").read_text()
