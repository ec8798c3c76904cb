#!/usr/bin/env bash
# The checks and timings that need a GPU, in one go, for a machine lent for a short while.
#
#   bash benchmarks/gpu-check.sh OUT DATA STAGE...
#
# OUT: where the logs, JSON and plots go. DATA: a folder holding FashionMNIST/raw (the full
# data set). Stages, run in the order given:
#   tests   pytest tests/test_gpu.py and the device tests (GPU path = CPU path, a real OOM)
#   bench   ps-bench train, 1 GPU worker at D2L's batch 256: ps sync/async against one
#           process, DDP (NCCL) and the compute bound
#   d2l1    D2L's 1-GPU recipe through ps-local: batch 256, lr 0.1, EPOCHS epochs
#   d2l2    D2L's 2-GPU recipe (2 workers x 256, lr 0.2) with both workers on GPU 0
#   comm    ps-bench comm on that host's cores (no GPU used): sync round against the floor
#   compress  1 GPU worker, 120 steps of batch 256 with each --compress: where a step's time
#           goes (scripts/step_times.py over each run's --log-dir)
# EPOCHS (default 10) sets the epochs of d2l1 and d2l2.
# Assumes the project and its dependencies import (pip install -e . on that machine).
set -uo pipefail
out=$1 data=$2
shift 2
epochs=${EPOCHS:-10}
mkdir -p "$out"
status=0

run_stage() {  # name, command...: time it, log it, remember a failure and go on
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local code=$?
    echo "=== $name: exit $code after $((SECONDS - start)) s"
    tail -n 25 "$out/$name.log"
    [ $code -eq 0 ] || status=1
}

two_workers_on_gpu0() {  # ps-local places one worker per GPU; here two share the one GPU
    local endpoint_file=$out/d2l2.endpoint
    rm -f "$endpoint_file"
    ps-server --bind 'tcp://127.0.0.1:*' --endpoint-file "$endpoint_file" --workers 2 \
        --dataset fashion-mnist --data-dir "$data" --batch-size 256 --lr 0.2 \
        --epochs "$epochs" --eval-device cuda:0 --summary "$out/d2l2-summary.json" &
    local server=$!
    trap 'kill $(jobs -p) 2>/dev/null' EXIT  # a stage that fails leaves no process behind
    for _ in $(seq 600); do [ -s "$endpoint_file" ] && break; sleep 0.1; done
    if [ ! -s "$endpoint_file" ]; then
        echo "ps-server wrote no endpoint in 60 s" >&2
        return 1
    fi
    local workers=()
    for rank in 0 1; do
        ps-worker --server "$(cat "$endpoint_file")" --gpu 0 --data-dir "$data" \
            --progress log --name "gpu0-worker$rank" &
        workers+=($!)
    done
    local code=0
    wait "$server" || code=$?
    for pid in "${workers[@]}"; do wait "$pid" || code=$?; done
    return $code
}

compress_runs() {  # one short ps-local run per compression, then the step-time table
    local runs=()
    for compress in none fp16 bf16 topk:0.01; do
        local dir=$out/logs/compress-${compress/:/-}
        ps-local --device cuda --workers 1 --dataset fashion-mnist --data-dir "$data" \
            --batch-size 256 --lr 0.1 --max-steps 120 --eval-device cuda:0 \
            --compress "$compress" --log-dir "$dir" --summary "$dir/summary.json" || return 1
        runs+=("$dir")
    done
    python3 scripts/step_times.py --skip 20 "${runs[@]}"
}

for stage in "$@"; do
    case $stage in
        tests)
            run_stage tests python3 -m pytest -p no:cacheprovider -q -s -rA \
                tests/test_gpu.py tests/test_device.py tests/test_models.py ;;
        bench)
            run_stage bench ps-bench train --workers 1 --device cuda --batch-size 256 \
                --steps 40 --threads 4 --repeat 2 --json "$out/bench.json" \
                --plot "$out/bench.png" ;;
        d2l1)
            run_stage d2l1 ps-local --device cuda --workers 1 --dataset fashion-mnist \
                --data-dir "$data" --batch-size 256 --lr 0.1 --epochs "$epochs" \
                --eval-device cuda:0 --summary "$out/d2l1-summary.json" ;;
        d2l2)
            run_stage d2l2 two_workers_on_gpu0 ;;
        compress)
            run_stage compress compress_runs ;;
        comm)
            run_stage comm ps-bench comm --workers 2 --model resnet18 --rounds 20 --repeat 2 \
                --json "$out/comm.json" --plot "$out/comm.png" ;;
        *)
            echo "unknown stage $stage (tests, bench, d2l1, d2l2, comm, compress)" >&2
            exit 2 ;;
    esac
done
exit $status
