"""The score of a mutmut run over tangram/core, per module, and its survivors.

    python tools/mutation_report.py [--equivalent tools/mutation_equivalent.txt] [--json] MUTANTS_DIR

Reads mutmut's per-file results (``MUTANTS_DIR/**/*.py.meta``). The score of a module is
killed / (killed + survived + no tests), where killed counts timeouts and crashes too (the
tests noticed), "no tests" are mutants no test of the subset reaches, and mutants named in
the equivalents file (one ``name  reason`` per line) are left out; those not run yet are
counted apart. Exit status 0; the caller reads the figures (docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {
    1: "killed",
    3: "killed",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "crash",
    -9: "crash",
    37: "killed",
}
OTHER = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", None: "not run", 2: "not run"}


def status(code: int | None) -> str:
    """mutmut's exit code of a mutant's test run, as one of this report's classes."""
    if code in KILLED:
        return "killed"
    return OTHER.get(code, "suspicious")


def load(mutants: Path) -> dict[str, dict[str, int | None]]:
    """module (``tangram/core/x.py``) -> mutant name -> exit code."""
    out: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = meta.relative_to(mutants).as_posix().removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            out[module] = codes
    return out


def read_equivalent(path: Path | None) -> dict[str, str]:
    """mutant name -> why it is equivalent (``#`` starts a comment line)."""
    if path is None or not path.exists():
        return {}
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            found[name] = reason.strip()
    return found


def summarise(results: dict[str, dict[str, int | None]], equivalent: dict[str, str]) -> dict[str, object]:
    modules: dict[str, dict[str, object]] = {}
    total: Counter[str] = Counter()
    survivors: list[str] = []
    for module, codes in results.items():
        count: Counter[str] = Counter()
        for name, code in codes.items():
            st = "equivalent" if name in equivalent else status(code)
            count[st] += 1
            if st in ("survived", "suspicious"):
                survivors.append(name)
        total.update(count)
        modules[module] = {"counts": dict(count), "score": _score(count)}
    known = {n for codes in results.values() for n in codes}
    return {
        "modules": modules,
        "total": {"counts": dict(total), "score": _score(total)},
        "survivors": sorted(survivors),
        "stale_equivalents": sorted(set(equivalent) - known),
    }


def _score(count: Counter[str]) -> float | None:
    judged = count["killed"] + count["survived"] + count["suspicious"] + count["no tests"]
    return None if judged == 0 else count["killed"] / judged


def print_table(summary: dict[str, object]) -> None:
    cols = ("killed", "survived", "suspicious", "equivalent", "no tests", "not run")
    print(f"{'module':34} " + " ".join(f"{c:>10}" for c in cols) + "      score")
    rows = dict(summary["modules"])  # type: ignore[call-overload]
    rows["all"] = summary["total"]
    for module, row in rows.items():
        counts = row["counts"]
        score = row["score"]
        shown = "-" if score is None else f"{100 * score:.1f}%"
        print(f"{module:34} " + " ".join(f"{counts.get(c, 0):>10}" for c in cols) + f" {shown:>10}")
    for name in summary["survivors"]:  # type: ignore[attr-defined]
        print(f"survived: {name}")
    for name in summary["stale_equivalents"]:  # type: ignore[attr-defined]
        print(f"stale equivalent (no such mutant now): {name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mutants", type=Path, help="mutmut's mutants/ folder")
    ap.add_argument("--equivalent", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--names", action="store_true", help="only the names of the mutants not killed")
    args = ap.parse_args(argv)
    results = load(args.mutants)
    equivalent = read_equivalent(args.equivalent)
    if args.names:  # what tools/mutation.sh re-runs with MUTATION_RERUN=1
        for codes in results.values():
            for name, code in codes.items():
                if name not in equivalent and status(code) in (
                    "survived",
                    "suspicious",
                    "no tests",
                    "not run",
                ):
                    print(name)
        return 0
    summary = summarise(results, equivalent)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
