"""The light install (issue 12): `pip install tangram-rl` brings only what the client needs.

setup.py's plain requirements are the client's (pyzmq, msgpack); the cluster side is the `[cluster]`
extra, which `[test]` includes. The client and the framework adapters import and build without any
cluster-side package: checked in a subprocess where importing those packages fails, as in a fresh
venv with the plain install (verified by hand: docs/integrations.md, "Installing").
"""

from __future__ import annotations

import ast
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[2]
CLIENT_REQUIREMENTS = {"pyzmq", "msgpack"}
CLUSTER_ONLY = ("asyncssh", "docker", "pydantic", "rich", "numpy", "pynvml", "click", "yaml")
FRAMEWORKS = ("verl", "skyrl_gym", "torch", "ray", "omegaconf")
# Where a module's top-level import lives in PyPI's namespace.
DISTRIBUTION = {"zmq": "pyzmq"}


def run_python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def setup_kwargs() -> dict[str, Any]:
    """What setup.py passes to `setup()` (run with `setup` replaced, so nothing is built)."""
    seen: dict[str, Any] = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        mp.undo()
    return seen


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_client_import_path_loads_no_cluster_package() -> None:
    code = (
        "import json, sys, tangram, tangram.client, tangram.integrations;"
        "tangram.AsyncClient; tangram.Client; tangram.ActionTimeout;"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = set(json.loads(run_python(code)))
    assert not loaded & {*CLUSTER_ONLY, "tangram_cli", "agent", "tangram.core", "tangram.sim"}


def test_client_and_adapters_work_without_cluster_or_framework_packages() -> None:
    """As in a light install: every cluster-side package and every framework fails to import."""
    blocked = (*CLUSTER_ONLY, *FRAMEWORKS)
    code = f"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
import tangram
from tangram.integrations import skyrl, verl
client = tangram.AsyncClient("tcp://127.0.0.1:9", name="light")
tool = verl.TangramSandboxTool({{"type": "native", "test_command": "pytest -n {{dop}}"}}, None)
env = skyrl.TangramSandboxEnv({{"max_turns": 3}}, {{"files": {{"a.py": "x = 1"}}}})
response = verl.ToolResponse(text="ok")
print(json.dumps([verl.BASE, skyrl.BASE, tool.name, env.max_turns, response.text,
                  sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})]))
"""
    assert json.loads(run_python(code)) == ["fallback", "fallback", "bash", 3, "ok", []]


def test_setup_splits_client_and_cluster_requirements() -> None:
    kw = setup_kwargs()
    assert names(kw["install_requires"]) == CLIENT_REQUIREMENTS
    extras = {k: names(v) for k, v in kw["extras_require"].items()}
    # everything the plain install used to bring beyond the client's two (and whatever the cluster
    # side needs since) is in `[cluster]`, and none of it in the plain install
    assert extras["cluster"] >= {
        "click",
        "asyncssh",
        "docker",
        "nvidia-ml-py",
        "rich",
        "pyyaml",
        "pydantic",
        "numpy",
    }
    assert not extras["cluster"] & CLIENT_REQUIREMENTS
    assert extras["cluster"] <= extras["test"]  # `pip install -e '.[test]'` (README, .ci/run) runs everything
    assert kw["entry_points"]["console_scripts"] == ["tangram=tangram_cli.main:cli"]


def third_party_imports(path: Path) -> set[str]:
    """Top-level modules a file imports when it is imported: its module-level import statements
    (those in a `try:` are optional by design, those in functions run only when called)."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"tangram", "__future__"}


@pytest.mark.parametrize("package", ["client", "integrations"])
def test_client_side_code_needs_only_the_plain_requirements(package: str) -> None:
    for path in sorted((ROOT / "tangram" / package).glob("*.py")):
        needed = {DISTRIBUTION.get(m, m) for m in third_party_imports(path)}
        assert needed <= CLIENT_REQUIREMENTS, f"{path.name} imports {needed - CLIENT_REQUIREMENTS}"


def test_install_commands_in_the_docs_name_real_extras() -> None:
    extras = set(setup_kwargs()["extras_require"])
    commands = []
    for doc in ("README.md", "docs/integrations.md"):
        commands += re.findall(r"pip install [^\n`]*", (ROOT / doc).read_text())
    named = {e for c in commands for group in re.findall(r"\[([\w,]+)\]", c) for e in group.split(",")}
    assert named and named <= extras, commands
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[cluster]' && tangram demo" in readme  # the demo needs the cluster side
    assert "pip install -e '.[test]' && python3 -m pytest" in readme


def test_the_command_from_a_client_only_install_names_the_cluster_extra() -> None:
    """Without click (a plain install), `tangram` says which install it needs instead of a traceback."""
    code = "import sys; sys.modules['click'] = None; from tangram_cli.main import cli"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "pip install 'tangram-rl[cluster]'" in r.stderr and "Traceback" not in r.stderr
