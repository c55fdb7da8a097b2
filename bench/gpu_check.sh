#!/usr/bin/env bash
# The GPU check (docs/gpu.md) for the machine this project is lent: one NVIDIA GPU, the machine's
# own python3 (3.12, torch 2.11, transformers), no network, no Ray, vLLM or SGLang. It installs
# only the wheels carried with the tree (`make gpu-wheels` -> .gpu-wheels/), runs each step under
# its own time limit (they add up to about 11 minutes; a device call runs at most 10, so a full
# check is two calls, see --steps) and writes every step's command, output tail and exit status,
# then the targets, to one results file. --dry-run (no GPU needed) checks that every
# file a step runs and every wheel of bench/gpu_wheels.txt is there, and writes the plan.
# --steps runs some steps only (keys: device,install,build,engine,train,update,profile,handoff,
# tests; a fresh machine needs install, and build before engine, train, update or profile).
#
# TANDEM_COMMIT names the tree in the results file (the device tool's copy has the base commit's
# .git under the session's working tree, so `git rev-parse` there names the wrong commit).
#
#   bash bench/gpu_check.sh --out FILE [--wheels DIR] [--steps KEY,...]
#   bash bench/gpu_check.sh --dry-run [--out FILE] [--wheels DIR]
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/bench/gpu_check_results.md"
WHEELS="$ROOT/.gpu-wheels"
DRY_RUN=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT="$2"; shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --steps) ONLY=",$2,"; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out FILE, --wheels DIR," \
                "--steps KEY,...)" >&2
           exit 2 ;;
    esac
    shift
done
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
SITE="${TMPDIR:-/tmp}/tandem-gpu-site"
TAIL_LINES=80
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
# every test file (or conftest's folder) that holds a gpu mark
GPU_TESTS="$(grep -rl --include='*.py' 'mark\.gpu' tests | sed 's#/conftest\.py$##' | sort -u | tr '\n' ' ')"
# the machine's own pytest plugins stay out: only the carried pytest-asyncio and pytest-timeout
PYTEST="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $PYTHON -m pytest -p pytest_asyncio.plugin -p pytest_timeout"

# key | name | time limit (s) | command
STEPS=(
    "device|device|10|nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader && $PYTHON -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, \"CUDA\", torch.version.cuda, \"transformers\", transformers.__version__)'"
    "install|install the carried wheels|20|rm -rf $SITE && $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE $WHEELS/*.whl && $PYTHON -c 'import tensordict, omegaconf, pytest_asyncio; print(\"tensordict\", tensordict.__version__)'"
    "build|build the 0.5B-shape model (random weights)|30|$PYTHON -c 'import sys; sys.path[:0] = [\"bench\", \"src\"]; import engine; from tandem.models import build_tiny_model; print(build_tiny_model(engine.MODELS[\"0.5b\"]))'"
    "engine|engine: native vs HF generate, bf16 and fp32|240|$PYTHON bench/gpu_engine.py --device cuda"
    "train|training step: packed vs padded, forward + backward + optimizer|55|$PYTHON bench/gpu_train_step.py --device cuda"
    "update|weight updates into a generating engine: full and LoRA, per-token versions|60|$PYTHON bench/gpu_update.py --device cuda"
    "profile|where a decode step's time goes (torch.profiler: launches, device busy, host parts)|60|$PYTHON bench/gpu_profile.py --device cuda"
    "handoff|weight handoff: shm over CUDA IPC between two processes|30|$PYTHON bench/sync.py --device cuda --sizes 1000 --engines naive,shm"
    "tests|gpu-marked tests, TP=2 ranks on one GPU among them (none needs Ray, vLLM or SGLang; those skip)|150|$PYTEST -q -rs -m gpu $GPU_TESTS"
)

# the files a command names (bench/..., tests/...): each must exist
named_files() { grep -oE '(bench|tests)/[A-Za-z0-9_./-]+' <<< "$1" | sort -u; }

# wheels of bench/gpu_wheels.txt missing from $WHEELS, one "name==version" per line
missing_wheels() {
    local line name version
    while read -r line; do
        line="${line%%#*}"; line="${line// /}"
        [ -n "$line" ] || continue
        name="$(tr 'A-Z.-' 'a-z__' <<< "${line%%==*}")"; version="${line#*==}"
        compgen -G "$WHEELS/${name}-${version}-*.whl" > /dev/null || echo "$line"
    done < bench/gpu_wheels.txt
}

rm -f "$OUT.targets"
COMMIT="${TANDEM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [ -z "${TANDEM_COMMIT:-}" ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
    COMMIT="$COMMIT with uncommitted changes (set TANDEM_COMMIT)"
fi
printf '# gpu_check %s\n\ncommit %s, %s\n' "$(date -u +%FT%TZ)" "$COMMIT" \
    "$([ "$DRY_RUN" = 1 ] && echo 'DRY RUN' || echo 'live run')" > "$OUT"

problems=()
command -v "$PYTHON" > /dev/null || problems+=("no $PYTHON on PATH")
for entry in "${STEPS[@]}"; do
    rest="${entry#*|}"
    for file in $(named_files "${entry##*|}"); do
        [ -e "$file" ] || problems+=("step '${rest%%|*}' runs $file, which does not exist")
    done
done
for key in ${ONLY//,/ }; do
    printf '%s\n' "${STEPS[@]}" | grep -q "^$key|" || problems+=("no step $key (--steps)")
done
for wheel in $(missing_wheels); do
    problems+=("wheel $wheel is not in $WHEELS (run: make gpu-wheels)")
done
if [ ${#problems[@]} -gt 0 ]; then
    printf '\ncannot run:\n' >> "$OUT"
    printf -- '- %s\n' "${problems[@]}" | tee -a "$OUT" >&2
    exit 2
fi
total_limit=0
for entry in "${STEPS[@]}"; do rest="${entry#*|*|}"; total_limit=$((total_limit + ${rest%%|*})); done
printf '\ncarried wheels: %s files, %s bytes in %s; gpu tests: %s; step limits add up to %s s\n' \
    "$(ls "$WHEELS"/*.whl | wc -l)" "$(cat "$WHEELS"/*.whl | wc -c)" "${WHEELS#"$ROOT"/}" \
    "$GPU_TESTS" "$total_limit" >> "$OUT"

if [ "$DRY_RUN" = 0 ] && ! nvidia-smi -L > /dev/null 2>&1; then
    echo "gpu_check.sh: no NVIDIA GPU (nvidia-smi -L failed); use --dry-run to check the plan" | tee -a "$OUT" >&2
    exit 2
fi

FAILED=0
SUMMARY=()
for entry in "${STEPS[@]}"; do
    key="${entry%%|*}"; rest="${entry#*|}"; name="${rest%%|*}"; rest="${rest#*|}"
    limit="${rest%%|*}"; command="${rest#*|}"
    [ -z "$ONLY" ] || [[ "$ONLY" == *",$key,"* ]] || continue
    printf '\n## %s\n\n```\n$ %s\n' "$name" "$command" >> "$OUT"
    if [ "$DRY_RUN" = 1 ]; then
        printf '(dry run: not executed; limit %s s)\n```\n' "$limit" >> "$OUT"
        SUMMARY+=("| $name | dry run | | $limit |")
        continue
    fi
    start=$(date +%s)
    log="$(mktemp)"
    timeout --kill-after=5 "$limit" bash -c "$command" > "$log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - start ))
    tail -n "$TAIL_LINES" "$log" >> "$OUT"
    grep -E '^(TARGET|RATIO) ' "$log" | sed "s/^/$name: /" >> "$OUT.targets"
    rm -f "$log"
    verdict="exit $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && verdict="exit $rc (past its limit)"
    printf '```\n%s after %s s (limit %s s)\n' "$verdict" "$seconds" "$limit" >> "$OUT"
    SUMMARY+=("| $name | $verdict | $seconds | $limit |")
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
done

printf '\n## Summary\n\n| step | result | seconds | limit |\n|---|---|---|---|\n' >> "$OUT"
printf '%s\n' "${SUMMARY[@]}" >> "$OUT"
if [ -s "$OUT.targets" ]; then
    printf '\nTargets and ratios:\n\n```\n' >> "$OUT"
    cat "$OUT.targets" >> "$OUT"
    printf '```\n' >> "$OUT"
    rm -f "$OUT.targets"
fi
printf '\n%s step(s) failed\n' "$FAILED" >> "$OUT"
echo "gpu_check.sh: results in $OUT ($FAILED failed step(s))"
[ "$FAILED" = 0 ]
