"""The import rules of docs/architecture.md hold for every module of tangram/, tangram_cli/ and agent/.

The table between ``<!-- import-rules -->`` and ``<!-- /import-rules -->`` in docs/architecture.md is the
rule: each row is a room (a name, its files, and the rooms it may import). This test reads that table,
so the map and the code cannot drift apart: every module must sit in exactly one room, and every import
of this repository's code (at the top of a module or inside a function, ``TYPE_CHECKING`` ones too) must
land in a room its own room may import.

Four rules are also checked straight on the code, so that loosening the table cannot loosen them: the
library (``tangram/``) never imports ``tangram_cli`` or ``agent``; ``tangram/core`` imports nothing of the
repository outside itself (its purity, no I/O, is tests/guards/test_core_purity.py); ``agent`` never imports
``tangram_cli``; the operator's side outside the commands (controller, bootstrap, inventories, ...) never
imports the benchmarks (``tangram_cli/bench/``) or the demo (``tangram_cli/demo/``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("tangram", "tangram_cli", "agent")


@dataclass(frozen=True)
class Room:
    name: str
    files: tuple[str, ...]  # "dir/" (everything below it) or "dir/file.py"
    may_import: frozenset[str]


def read_rules(text: str) -> dict[str, Room]:
    """The rooms of the import-rules table: | name | `files` ... | what it holds | rooms it may import |."""
    match = re.search(r"<!-- import-rules -->(.*?)<!-- /import-rules -->", text, flags=re.DOTALL)
    assert match, f"{DOC.name}: no <!-- import-rules --> table"
    rooms = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0] or set(cells[0]) <= set("-: ") or cells[0].lower() == "room":
            continue
        name = cells[0].strip("*` ")
        files = tuple(re.findall(r"`([^`]+)`", cells[1]))
        may = frozenset(w.strip("*` ") for w in cells[3].split(","))
        rooms[name] = Room(name, files, may)
    return rooms


def room_of(rel: str, rooms: dict[str, Room]) -> str | None:
    """The room whose most specific entry holds file ``rel``."""
    best, length = None, -1
    for room in rooms.values():
        for entry in room.files:
            hit = rel.startswith(entry) if entry.endswith("/") else rel == entry
            if hit and len(entry) > length:
                best, length = room.name, len(entry)
    return best


def module_file(root: Path, module: str) -> str | None:
    """``tangram.core.scheduler`` -> ``tangram/core/scheduler.py`` (a package: its ``__init__.py``)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def imports_of(root: Path, rel: str) -> list[tuple[int, str]]:
    """(line, module) for each import of this repository's code in file ``rel``."""
    path = root / rel
    package = rel[:-3].split("/")[:-1]  # a module's package; an __init__.py's is its own
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:  # `from pkg import mod` imports pkg.mod when that is a module
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if module_file(root, sub) else base))
    return [(line, m) for line, m in found if m.split(".")[0] in PACKAGES]


def python_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def violations(root: Path, rooms: dict[str, Room]) -> list[str]:
    bad = []
    for rel in python_files(root):
        home = room_of(rel, rooms)
        if home is None:
            bad.append(f"{rel}: in no room of the import-rules table (add it to docs/architecture.md)")
            continue
        for line, module in imports_of(root, rel):
            target = module_file(root, module)
            if target is None:
                bad.append(f"{rel}:{line}: imports {module}, which is no module of this repository")
                continue
            there = room_of(target, rooms)
            if there != home and there not in rooms[home].may_import:
                bad.append(f"{rel}:{line}: room {home} imports {module} (room {there}), which it may not")
    return bad


RULES = read_rules(DOC.read_text()) if DOC.exists() else {}


def test_the_table_names_known_rooms() -> None:
    assert RULES, "docs/architecture.md has no import-rules table"
    for room in RULES.values():
        assert room.files, f"room {room.name} lists no files"
        assert room.may_import <= set(RULES), f"room {room.name} may import unknown rooms"
        for entry in room.files:
            assert (ROOT / entry).exists(), f"room {room.name}: {entry} does not exist"


def test_every_import_follows_the_table() -> None:
    assert violations(ROOT, RULES) == []


@pytest.mark.parametrize(
    ("where", "forbidden"),
    [
        ("tangram/", ("tangram_cli/", "agent/")),  # the library never imports the operator side or the agent
        ("agent/", ("tangram_cli/",)),  # the agent bundle ships without tangram_cli
        # the controller, bootstrap and the rest of the operator's side never load benchmark or demo code
        ("tangram_cli/", ("tangram_cli/bench/", "tangram_cli/demo/")),
    ],
)
def test_the_fixed_rules_hold_on_the_code(where: str, forbidden: tuple[str, ...]) -> None:
    leaves = ("tangram_cli/commands/", "tangram_cli/bench/", "tangram_cli/demo/")  # may use the benches
    bad = [
        f"{rel}:{line}: imports {module}"
        for rel in python_files(ROOT)
        if rel.startswith(where) and not (where == "tangram_cli/" and rel.startswith(leaves))
        for line, module in imports_of(ROOT, rel)
        if (module_file(ROOT, module) or "").startswith(forbidden)
    ]
    assert bad == []


def test_the_core_imports_only_itself() -> None:
    bad = [
        f"{rel}:{line}: imports {module}"
        for rel in python_files(ROOT)
        if rel.startswith("tangram/core/")
        for line, module in imports_of(ROOT, rel)
        if not (module_file(ROOT, module) or "").startswith("tangram/core/")
    ]
    assert bad == []


def test_the_guard_catches_a_forbidden_import(tmp_path: Path) -> None:
    for rel, text in {
        "tangram/__init__.py": "",
        "tangram/core/__init__.py": "",
        "tangram/core/bad.py": "import tangram_cli.state\nfrom tangram import errors\nfrom . import ok\n",
        "tangram/core/ok.py": "",
        "tangram/errors.py": "from tangram.missing import x\n",
        "tangram/stray.py": "",
        "tangram_cli/__init__.py": "",
        "tangram_cli/state.py": "def f():\n    from tangram.core import bad\n",
        "agent/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    table = [
        "| Room | Files | Holds | May import |",
        "|---|---|---|---|",
        "| core | `tangram/core/` | x | core |",
        "| base | `tangram/errors.py` `tangram/__init__.py` | x | base |",
        "| cli | `tangram_cli/` | x | cli, core, base |",
        "| agent | `agent/` | x | agent |",
    ]
    rules = read_rules("\n".join(["<!-- import-rules -->", *table, "<!-- /import-rules -->"]))
    found = violations(tmp_path, rules)
    assert any("tangram/core/bad.py:1: room core imports tangram_cli.state" in v for v in found), found
    assert any("tangram/core/bad.py:2: room core imports tangram.errors" in v for v in found), found
    assert any("tangram/errors.py:1: imports tangram.missing" in v for v in found), found
    assert any("tangram/stray.py: in no room" in v for v in found), found
    assert len(found) == 4, found  # the relative import and the CLI's function-local one are allowed


def test_a_room_inside_another_room_is_its_own(tmp_path: Path) -> None:
    """`tangram_cli/bench/` lies inside `tangram_cli/`: its files are in room bench, not cli."""
    for rel, text in {
        "tangram_cli/__init__.py": "",
        "tangram_cli/state.py": "from tangram_cli.bench import load\n",
        "tangram_cli/bench/__init__.py": "",
        "tangram_cli/bench/load.py": "from tangram_cli import state\n",
        "tangram_cli/commands/__init__.py": "",
        "tangram_cli/commands/bench.py": "from tangram_cli.bench import load\nimport tangram_cli.state\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    table = [
        "| Room | Files | Holds | May import |",
        "|---|---|---|---|",
        "| commands | `tangram_cli/commands/` | x | commands, bench, cli |",
        "| bench | `tangram_cli/bench/` | x | bench, cli |",
        "| cli | `tangram_cli/` | x | cli |",
    ]
    rules = read_rules("\n".join(["<!-- import-rules -->", *table, "<!-- /import-rules -->"]))
    assert room_of("tangram_cli/bench/load.py", rules) == "bench"
    assert room_of("tangram_cli/bench/__init__.py", rules) == "bench"
    assert room_of("tangram_cli/state.py", rules) == "cli"
    found = violations(tmp_path, rules)
    assert found == [
        "tangram_cli/state.py:1: room cli imports tangram_cli.bench.load (room bench), which it may not"
    ]
