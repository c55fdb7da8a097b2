#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): on a fresh checkout and one NVIDIA GPU, install what is
# needed, run every gpu-marked test (native CUDA path, NCCL / CUDA IPC weight sync, the backend
# conformance suite for native, vllm and sglang on CUDA) and bench/engine.py on the GPU (native
# vs vLLM vs HF, 0.5B shape, bf16); every step's command, output tail and exit code go to one
# results file. --dry-run writes the plan without installing or running anything.
#
#   bash bench/gpu_check.sh [--dry-run] [--out FILE] [--skip-install]
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/bench/gpu_check_results.md"
DRY_RUN=0
SKIP_INSTALL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --skip-install) SKIP_INSTALL=1 ;;
        --out) OUT="$2"; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --skip-install, --out FILE)" >&2
           exit 2 ;;
    esac
    shift
done
cd "$ROOT" || exit 2
PYTHON="$(command -v python3.11 || command -v python3)"
FAILED=0

# step NAME TIMEOUT_S COMMAND...: run one step, append its command, output tail and exit code
step() {
    local name="$1" limit="$2"
    shift 2
    printf '\n## %s\n\n```\n$ %s\n' "$name" "$*" >> "$OUT"
    if [ "$DRY_RUN" = 1 ]; then
        printf '(dry run: not executed; limit %s s)\n```\n' "$limit" >> "$OUT"
        return 0
    fi
    local start log rc
    start=$(date +%s)
    log="$(mktemp)"
    timeout "$limit" bash -c "$*" > "$log" 2>&1
    rc=$?
    tail -n 40 "$log" >> "$OUT"
    rm -f "$log"
    printf '```\nexit %s after %s s\n' "$rc" "$(( $(date +%s) - start ))" >> "$OUT"
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
}

printf '# gpu_check %s\n\ncommit %s, %s\n' "$(date -u +%FT%TZ)" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    "$([ "$DRY_RUN" = 1 ] && echo 'DRY RUN' || echo 'live run')" > "$OUT"

if [ "$DRY_RUN" = 0 ] && ! nvidia-smi -L > /dev/null 2>&1; then
    echo "gpu_check.sh: no NVIDIA GPU (nvidia-smi -L failed); use --dry-run to see the plan" | tee -a "$OUT" >&2
    exit 2
fi

# Three venvs: vllm and sglang each pin their own CUDA torch, tandem pins torch==2.13.0.
# tandem goes into the engine venvs without deps (its torch pin would fight theirs).
DEPS="transformers tokenizers safetensors ray omegaconf numpy tqdm tensordict pyarrow matplotlib ninja pytest hypothesis pytest-asyncio pytest-timeout"
step "device" 30 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv"
if [ "$SKIP_INSTALL" = 0 ]; then
    step "install: tandem (.venv-gpu)" 240 \
        "$PYTHON -m venv .venv-gpu && .venv-gpu/bin/pip install -q torch==2.13.0 && .venv-gpu/bin/pip install -q -e '.[dev]'"
    step "install: vllm (.venv-gpu-vllm)" 300 \
        "$PYTHON -m venv .venv-gpu-vllm && .venv-gpu-vllm/bin/pip install -q vllm && .venv-gpu-vllm/bin/pip install -q $DEPS && .venv-gpu-vllm/bin/pip install -q --no-deps -e ."
    step "install: sglang (.venv-gpu-sglang)" 300 \
        "$PYTHON -m venv .venv-gpu-sglang && .venv-gpu-sglang/bin/pip install -q 'sglang[srt]' && .venv-gpu-sglang/bin/pip install -q $DEPS && .venv-gpu-sglang/bin/pip install -q --no-deps -e ."
fi
step "gpu-marked tests (native CUDA, NCCL / CUDA IPC sync)" 120 \
    ".venv-gpu/bin/python -m pytest -q -m gpu tests"
step "conformance: native on CUDA" 60 \
    "TANDEM_CONFORMANCE_DEVICE=cuda .venv-gpu/bin/python -m pytest -q tests/conformance -k native"
step "conformance: vllm on CUDA" 150 \
    ".venv-gpu-vllm/bin/python -m pytest -q -m vllm tests/conformance"
step "conformance: sglang on CUDA" 150 \
    ".venv-gpu-sglang/bin/python -m pytest -q -m gpu tests/conformance -k sglang"
step "bench: native vs vLLM vs HF, 0.5B shape, bf16" 120 \
    ".venv-gpu-vllm/bin/python bench/engine.py --engines native,hf,vllm --models 0.5b --device cuda --dtype bfloat16"

printf '\n%s step(s) failed\n' "$FAILED" >> "$OUT"
echo "gpu_check.sh: results in $OUT ($FAILED failed step(s))"
[ "$FAILED" = 0 ]
