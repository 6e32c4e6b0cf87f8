#!/usr/bin/env bash
# Mutation testing of the scheduling core (tangram/core) against the fast core subset
# (`pytest tests/core -m core_fast`), with mutmut configured in setup.cfg [mutmut].
# Runs on a scratch copy of the working tree, never in it (mutmut writes ./mutants), niced and
# bounded in time; the results are kept there, so a second run resumes where one stopped.
#
#   tools/mutation.sh                          # every module of tangram/core, 45 minutes at most
#   tools/mutation.sh scheduler cpu_pass       # only these modules (tangram/core/<name>.py)
#   MUTATION_MINUTES=20 MUTATION_CHILDREN=1 tools/mutation.sh queues
#   MUTATION_RERUN=1 tools/mutation.sh         # after adding tests: re-run only the mutants that
#                                              # survived (mutmut keeps earlier verdicts otherwise)
#   MUTATION_FRESH=1 tools/mutation.sh         # forget earlier results (the core changed)
#
# Needs `pip install mutmut==3.8.1` (not in the `test` extra: it brings libcst and textual).
# Prints the score per module and the survivors (tools/mutation_report.py); docs/testing.md
# lists the survivors of the last recorded run and why each is equivalent or what kills it.
set -euo pipefail

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${MUTATION_DIR:-${TMPDIR:-/tmp}/tangram-mutation}
minutes=${MUTATION_MINUTES:-45}
children=${MUTATION_CHILDREN:-$(nproc)}

command -v mutmut >/dev/null || { echo "mutmut is not installed: pip install mutmut==3.8.1" >&2; exit 2; }
if [[ -n "${MUTATION_FRESH:-}" ]]; then rm -rf "$work"; fi
mkdir -p "$work"
# a fresh copy of the tree beside the kept results (a file deleted here must not linger there)
find "$work" -mindepth 1 -maxdepth 1 ! -name mutants ! -name .mutation-selection -exec rm -rf {} +
rm -rf "$work/mutants/tests"
# the tracked and untracked, not ignored files: what the tests see in the working tree
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [[ -e $f ]]; then printf '%s\0' "$f"; fi; done \
    | tar --null -T - -cf -) | (cd "$work" && tar -xf -)

cd "$work"
if (($#)); then  # only the named modules: rewrite only_mutate in the copy's setup.cfg
    python - "$@" <<'PY'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
cfg["mutmut"]["only_mutate"] = "\n" + "\n".join(f"tangram/core/{m.removesuffix('.py')}.py" for m in sys.argv[1:])
with open("setup.cfg", "w") as f:
    cfg.write(f)
PY
fi

# mutmut keeps its results in mutants/ and reuses them (a second run resumes where a bounded one
# stopped), but only for the same modules: another selection starts afresh
selection="${*:-all}"
if [[ "$(cat .mutation-selection 2>/dev/null)" != "$selection" ]]; then rm -rf mutants; fi
printf '%s' "$selection" > .mutation-selection

echo "mutation run in $work: ${children} children, at most ${minutes} min" >&2
# SIGINT: mutmut stops its workers and keeps every result it has (exit 124 on the bound)
rc=0
names=()
if [[ -n "${MUTATION_RERUN:-}" && -d mutants ]]; then  # only the mutants earlier runs did not kill
    mapfile -t names < <(python "$repo/tools/mutation_report.py" --names \
        --equivalent "$repo/tools/mutation_equivalent.txt" mutants)
    echo "re-running ${#names[@]} mutants not killed before" >&2
    if ((${#names[@]} == 0)); then names=("-"); fi
fi
if [[ "${names[0]:-}" != "-" ]]; then
    nice -n 19 timeout --signal=INT --kill-after=60 "${minutes}m" \
        mutmut run --max-children "$children" "${names[@]}" || rc=$?
fi
nice -n 19 python "$repo/tools/mutation_report.py" --equivalent "$repo/tools/mutation_equivalent.txt" mutants
exit "$rc"
