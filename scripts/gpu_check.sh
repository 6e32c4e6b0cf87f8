#!/usr/bin/env bash
# GPU check for a lent CUDA machine (fresh, maybe offline): the GPU host tests on real devices, a small
# host->device restore-bandwidth bench, and the end-to-end client -> controller -> agent test on the GPU.
# Run from anywhere:  bash scripts/gpu_check.sh
# Writes the whole output to $OUT/gpu_check.log when $OUT is set. Finishes in about 3-5 minutes.
# Exit status: the pytest status (0 = passed), or 3 when the tests passed but torch/CUDA was missing.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
if [[ -n "${OUT:-}" && -z "${GPU_CHECK_LOGGING:-}" ]]; then
  mkdir -p "$OUT"
  GPU_CHECK_LOGGING=1 bash "${BASH_SOURCE[0]}" "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
PY="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

step "machine"
"$PY" -V
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 | head -16
else
  echo "nvidia-smi: not found"
fi

step "python packages"
# import name -> pip name; torch is never installed here (it is large): it must be preinstalled.
declare -A PIP=([pytest]=pytest [pytest_timeout]=pytest-timeout [pytest_asyncio]=pytest-asyncio
  [hypothesis]=hypothesis [msgpack]=msgpack [zmq]=pyzmq [pynvml]=nvidia-ml-py [yaml]=pyyaml [click]=click
  [rich]=rich [pydantic]=pydantic [numpy]=numpy [asyncssh]=asyncssh [docker]=docker)
missing=()
for mod in "${!PIP[@]}"; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("${PIP[$mod]}")
done
if ((${#missing[@]})); then
  echo "missing: ${missing[*]} -- trying pip (fails fast when offline)"
  timeout 90 "$PY" -m pip install -q --retries 0 --timeout 10 "${missing[@]}" \
    || echo "WARNING: could not install: ${missing[*]} (offline?); tests that import them will fail"
else
  echo "all test dependencies present"
fi
if ! "$PY" -c "import tangram, agent.gpu" >/dev/null 2>&1; then
  timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "note: editable install failed; using PYTHONPATH=$REPO"
fi
TORCH_OK=1
if ! "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"; then
  echo "ERROR: torch is not installed; the torch runtime tests will skip. Install it (pip install torch) and rerun."
  TORCH_OK=0
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "ERROR: torch has no usable CUDA here; the torch GPU tests will skip."
  TORCH_OK=0
fi
"$PY" - <<'EOF'
from agent.gpu import nvml
gpus, reason = nvml.discover()
print(f"NVML: {len(gpus)} device(s)" + (f" ({reason})" if reason else ""))
for g in gpus:
    print(f"  {g.index} {g.uuid} {g.name} {g.memory_total_mib} MiB, bus {g.pci_bus_id}, cpus {len(g.cpus)}")
EOF

step "pytest: tests/gpu + tests/agent/test_gpu_host.py (real GPUs included)"
timeout 200 "$PY" -m pytest tests/gpu tests/agent/test_gpu_host.py -m 'gpu or not gpu' -q -rs -s \
  --ignore tests/gpu/test_gpu_e2e.py -p no:cacheprovider --timeout 180 ${OUT:+--junitxml "$OUT/gpu_junit.xml"}
rc=$?
echo "pytest exit status: $rc"

step "bandwidth bench (pinned vs pageable H2D; torch-runtime restore)"
if ((TORCH_OK)); then
  timeout 90 "$PY" -m agent.gpu.bench --sizes-mib 256,1024,4096 --runtime-mib 2048 --repeat 3 \
    || echo "bench failed or timed out (status $?)"
else
  echo "skipped: no torch with CUDA"
fi

step "end to end: client -> in-process controller -> real agent (NVML, torch runtime): tests/gpu/test_gpu_e2e.py"
timeout 150 "$PY" -m pytest tests/gpu/test_gpu_e2e.py -q -rs -s -p no:cacheprovider \
  ${OUT:+--junitxml "$OUT/gpu_e2e_junit.xml"}
e2e_rc=$?
echo "end-to-end pytest exit status: $e2e_rc"
if ((rc == 0)); then rc=$e2e_rc; fi

step "done"
echo "pytest status $rc (end to end $e2e_rc); torch+CUDA usable: $TORCH_OK; log: ${OUT:-(no \$OUT)}/gpu_check.log"
if ((rc == 0 && TORCH_OK == 0)); then exit 3; fi
exit "$rc"
