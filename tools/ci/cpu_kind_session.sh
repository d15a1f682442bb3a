#!/usr/bin/env bash
# One prepared CPU session (issue 35): where this machine's CPU kind stands on the issue's goals,
# in one command from the root of a clean checkout (2 cores: ~70-90 minutes for everything).
#
#   bash tools/ci/cpu_kind_session.sh                  # every step, in this order
#   bash tools/ci/cpu_kind_session.sh start batched    # the steps named
#
# Steps (each logs to $OUT/<step>.log; a failed step is reported and the next one still runs):
#   suite    the README's test command (`python3 -m nox -s tests`)
#   start    `LLM()` of the embedded model from fresh processes, cold and warm
#   single   single-stream decode, the default config against llama.cpp on the same GGUF (builds
#            llama-cpp-python from source the first time: `nox -s llamacpp`, minutes)
#   batched  seed-offline and many-short (128 requests): the default config and w8a8 (where the
#            CPU has an int8 matrix unit) against HF generate in bf16, interleaved, medians of 3
#   vllm     the same two profiles against vLLM's CPU build (bf16), the default config, bf16 and
#            w8a8 beside it (`nox -s vllm`: vLLM in a virtualenv of its own, ~3 GB the first
#            time; vLLM starts in 2-3 minutes)
#   gates    the card gates keyed by CPU kind (P2-002 .. P2-006: `nox -s card -- ID`), which
#            record this machine's evidence (a card already done stays done on a pass)
#   matrix   always after the others (issue 59 item 3): this commit's entry in
#            worklog/kinds/<kind>.json (`python -m minisgl.benchmark.kind_matrix record`): each
#            step's exit code, the suite's counts and failing tests where it ran, the ratios of
#            the day's records of this kind; the site's CPU kinds page shows it
# Records go to worklog/baselines/<what>-cpu-smollm2-<kind>-<UTC day>.json, the kind as the
# records and gates name it (amd-epyc, intel-amx, ...), the kind's record to worklog/kinds/;
# nothing is committed.
set -u
cd "$(dirname "$0")/../.."
STEPS="suite start single batched vllm gates matrix"
CARDS="P2-002 P2-003 P2-004 P2-005 P2-006"  # every card with a gate keyed by cpu:<kind>
steps=("$@")
[ ${#steps[@]} = 0 ] && read -r -a steps <<<"$STEPS"
for s in "${steps[@]}"; do
    case " $STEPS " in
    *" $s "*) ;;
    *) echo "unknown step '$s': the steps are $STEPS" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-cpu-kind-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -m pip install --quiet "nox>=2024.10" "uv>=0.4" || exit 1
python3 -m nox -s tests --install-only >"$OUT/install.log" 2>&1 || { tail -n 20 "$OUT/install.log"; exit 1; }
PY=.nox/tests/bin/python
KIND=$("$PY" -c "from cardgate.hardware import cpu_kind; print(cpu_kind())") || exit 1
DAY=$(date -u +%Y%m%d)
BASE=worklog/baselines
echo "CPU kind: $KIND ($(nproc) cores); logs in $OUT, records in $BASE/*-$KIND-$DAY.json"
status=0
rcs=()  # NAME=EXIT_CODE of each step run, for the matrix step

step() {  # step NAME CMD...: output to $OUT/NAME.log, the exit code reported
    local name=$1 t0=$SECONDS
    shift
    echo "=== $name"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
    tail -n 8 "$OUT/$name.log"
    [ "$rc" = 0 ] || status=1
    rcs+=("$name=$rc")
}

run_suite() { python3 -m nox -s tests; }
run_start() {
    nice -n -15 "$PY" -m minisgl.benchmark.startup --repeats 3 --threads 2 \
        --out "$BASE/startup-cpu-smollm2-$KIND-$DAY.json"
}
run_single() {
    python3 -m nox -s llamacpp -- --profiles single --configs default --hf "" --threads 2 \
        --repeats 3 --llamacpp --no-quality --out "$BASE/cpu-speed-smollm2-single-$KIND-$DAY.json"
}
run_batched() {
    local configs=default,w8a8 why
    # W8A8 refuses a CPU without an int8 matrix unit (the x86-avx2 kind): measured without it
    why=$("$PY" -c "from minisgl.testing.capability import int8_matrix_unit_missing as m; print(m() or '')")
    [ -n "$why" ] && { configs=default; echo "w8a8 left out: $why"; }
    nice -n -15 "$PY" -m minisgl.benchmark.cpu_speed --profiles seed-offline,many-short \
        --configs "$configs" --hf bf16 --set many-short.num_requests=128 --threads 2 \
        --repeats 3 --no-quality --out "$BASE/cpu-speed-smollm2-batched-$KIND-$DAY.json"
}
run_vllm() {
    local configs=default,bf16,w8a8 why
    why=$("$PY" -c "from minisgl.testing.capability import int8_matrix_unit_missing as m; print(m() or '')")
    [ -n "$why" ] && { configs=default,bf16; echo "w8a8 left out: $why"; }
    python3 -m nox -s vllm -- --vllm --profiles seed-offline,many-short --configs "$configs" \
        --hf "" --set many-short.num_requests=128 --threads 2 --repeats 3 --no-quality \
        --out "$BASE/cpu-speed-smollm2-vllm-$KIND-$DAY.json"
}
run_gates() {
    local rc=0 card
    for card in $CARDS; do
        echo "--- $card"
        python3 -m nox -s card -- "$card" || rc=1
    done
    return $rc
}
run_matrix() {
    local suite=() ran
    ran=$(IFS=,; echo "${rcs[*]-}")
    case ",$ran," in *,suite=*) suite=(--suite-log "$OUT/suite.log") ;; esac
    "$PY" -m minisgl.benchmark.kind_matrix record --kind "$KIND" --dir worklog/kinds \
        ${suite[@]+"${suite[@]}"} --steps "$ran" "$BASE"/*-"$KIND"-"$DAY".json
}

for s in "${steps[@]}"; do  # the matrix last, whatever the order named
    [ "$s" = matrix ] || step "$s" "run_$s"
done
case " ${steps[*]} " in *" matrix "*) step matrix run_matrix ;; esac
exit $status
