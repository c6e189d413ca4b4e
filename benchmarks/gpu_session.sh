#!/usr/bin/env bash
# What to run on a lent GPU machine, in calls that each end inside 10 minutes (docs/performance-gpu.md,
# "The GPU grid"). Run from the repository root, with the machine's own python3 (torch with CUDA,
# triton, transformers); moelab is used from src/ without installing. Output goes to $OUT (the
# device tool's folder) or ./runs/gpu.
#
#   bash benchmarks/gpu_session.sh tests      # versions, the whole default test suite (CUDA tests included)
#   bash benchmarks/gpu_session.sh suite-a    # moelab bench suite --device cuda: the Mixtral- and OLMoE-like shapes
#   bash benchmarks/gpu_session.sh suite-b    # the Qwen3-MoE- and DeepSeek-V3-like shapes
#   bash benchmarks/gpu_session.sh compete    # the competition's every-expert pass, grouped and Triton
set -euo pipefail
part="${1:-}"
out="${OUT:-runs/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

versions() {
    "$py" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("triton", "transformers", "megablocks", "torchtitan", "sonicmoe"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(name, "not importable:", type(e).__name__)
EOF
}

case "$part" in
    tests)
        versions | tee "$out/versions.txt"
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$out/versions.txt" || true
        # every failure in one call (no -x), stopped before the device tool's 10-minute limit
        timeout 540 "$py" -m pytest -q -p no:cacheprovider -rfE --durations=15 2>&1 | tee "$out/tests.log"
        ;;
    suite-a | suite-b)
        models=$([ "$part" = suite-a ] && echo mixtral,olmoe || echo qwen3,deepseek-v3)
        versions | tee "$out/versions.txt"
        "$py" -m moelab bench suite --device cuda --models "$models" --out "$out/$part.json" --force 2>&1 | tee "$out/$part.log"
        ;;
    compete)
        for pass in grouped triton; do
            "$py" -m moelab bench compete --device cuda --all-pass "$pass" 2>&1 | tee "$out/compete-$pass.log"
        done
        ;;
    *)
        echo "usage: bash benchmarks/gpu_session.sh tests|suite-a|suite-b|compete" >&2
        exit 2
        ;;
esac
