#!/usr/bin/env bash
# The checks a GPU machine is lent for, as one script: the device's time is short (15 minutes a
# session, start included) and it returns at most 8 files, so this writes everything into one
# tarball, $OUT/gpu_checks.tgz, packed again after every part (a part cut short still returns
# what came before). Run from the repo root, with the project's dependencies importable:
#
#   bash .device/run.sh bash tools/gpu_checks.sh              # tests, ranks, round
#   bash .device/run.sh bash tools/gpu_checks.sh population   # a part alone
#
# Parts (each under its own time limit, in seconds, an environment variable):
#   tests       the CUDA-only tests (`pytest -m cuda`)                                 T_TESTS=240
#   ranks       1, 2 and 4 ranks sharing the GPU (benchmarks/ranks.py)                 T_RANKS=150
#   population  GPU memory of POP_SIZES clients (default 10000; 1,000 was measured), POP_FAMILIES
#               (mlp lenet5), idle on the GPU or the host: four runs side by side    T_POP=420
#               (benchmarks/simulate_scale.py; memory, not time). Each round's memory is
#               logged as it ends, so a run its limit cuts short still has its rounds'.
#               POP_EVAL (default 0: every client) is round.eval_clients: 200 evaluates and
#               finalizes a sample, so that a run of 10,000 clients ends within its limit.
#   round       stacked against client by client (benchmarks/gpu_round.py), the parts
#               ROUND_PARTS (default fml20 pfml fml100: all seven do not fit)          T_ROUND=120
#   papers      paper rows at their full size (benchmarks/reproduce.py run ROW --device cuda
#               --checkpoint), the rows PAPER_ROWS side by side, started in the background:
#               the parts after it run beside them, and the script waits for them at the end.
#               A row cut short keeps its finished runs (checkpoint); PAPER_FROM, a folder
#               holding an earlier call's reproduce/ROW (carried, e.g. .device/reproduce),
#               continues each row from its checkpoint there                          T_PAPERS=360
# One call may run 600 s: `tests ranks round` fit in one (the default), `population` in another.
# Timed parts (ranks, round) run alone: put them before `papers`.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/gpu_checks_out}
W=$(mktemp -d)
D=${DATA:-.device/data/fashion-mnist}
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$W/log.txt"; }
pack() { mkdir -p "$O" && tar czf "$O/gpu_checks.tgz" -C "$W" .; }
trap pack EXIT

# What the project imports and a GPU machine may lack: fail before spending the device's time.
missing=$(python3 - <<'PY'
import importlib.util
mods = ["torch", "pydantic", "pydantic_settings", "paho", "cryptography", "psutil", "tomli_w"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
if [[ -n $missing ]]; then
  say "missing modules: $missing (add their wheels to .device/whl before the next run)"
  exit 1
fi
nvidia-smi > "$W/nvidia-smi.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" >> "$W/nvidia-smi.txt" 2>&1

tests() {
  timeout "${T_TESTS:-240}" python3 -m pytest -m cuda -p no:cacheprovider -q -rs \
    tests/coordinator/test_fleets.py tests/coordinator/test_ranks.py tests/edge_sdk/test_cohort.py \
    tests/edge_sdk/test_device.py tests/edge_sdk/test_graphs.py > "$W/cuda_tests.txt" 2>&1
}

ranks() {
  timeout "${T_RANKS:-150}" python3 benchmarks/ranks.py --device cuda --dataset fashion_mnist \
    --data-root "$D" --clients 64 --rounds 3 --configs 1x2 2x2 4x2 --repeat 2 \
    --json-out "$W/ranks.json" > "$W/ranks.txt" 2>&1
}

population() {
  local fam n idle pids
  for n in ${POP_SIZES:-10000}; do
    pids=()
    for fam in ${POP_FAMILIES:-mlp lenet5}; do
      for idle in memory host; do
        timeout "${T_POP:-420}" python3 benchmarks/simulate_scale.py --parts population \
          --device cuda --data-root "$D" --population-families $fam --population-sizes $n \
          --idle $idle --scale-rounds 1 --threads 1 --eval-clients "${POP_EVAL:-0}" \
          --json-out "$W/pop_${fam}_${n}_${idle}_${POP_EVAL:-0}.json" \
          > "$W/pop_${fam}_${n}_${idle}_${POP_EVAL:-0}.txt" 2>&1 &
        pids+=($!)
      done
    done
    wait "${pids[@]}"  # these runs, not a papers row started before them
  done
}

round() {
  # shellcheck disable=SC2086 # ROUND_PARTS is a list of words
  timeout "${T_ROUND:-120}" python3 benchmarks/gpu_round.py --device cuda --no-ops --rounds 3 \
    --parts ${ROUND_PARTS:-fml20 pfml fml100} --json-out "$W/gpu_round.json" > "$W/gpu_round.txt" 2>&1
}

papers() {
  local row
  for row in ${PAPER_ROWS:-fml-fmnist-p6-lenet5}; do
    if [[ -n ${PAPER_FROM:-} && -d $PAPER_FROM/$row ]]; then
      mkdir -p "$W/reproduce" && cp -r "$PAPER_FROM/$row" "$W/reproduce/" && say "$row: from $PAPER_FROM"
    fi
    timeout "${T_PAPERS:-360}" python3 benchmarks/reproduce.py run "$row" --device cuda \
      --checkpoint --data-root "$D" --out "$W/reproduce" > "$W/paper_$row.txt" 2>&1 &
  done
}

parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(tests ranks round)
for part in "${parts[@]}"; do
  case $part in
    tests | ranks | population | round | papers) say "$part: start"; "$part"; say "$part: exit $?"; pack ;;
    *) say "unknown part $part (tests, ranks, population, round, papers)"; exit 2 ;;
  esac
done
wait  # the papers' rows, where they run in the background
say "done"
