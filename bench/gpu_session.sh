#!/usr/bin/env bash
# What a lent GPU machine is asked, in as few calls as its lease allows (see README, "Seen on a real GPU").
#
#   bash bench/gpu_session.sh doctor    # ddpwatch doctor as shipped, one rank
#   bash bench/gpu_session.sh attach [RUN...]  # attach on a user's own loops, two or four ranks sharing the GPU:
#                                       # FSDP2, HSDP (2 replicas x 2 shards), torch.compile'd DDP (inductor), and
#                                       # the Hugging Face Trainer's callback on its DDP and on its FSDP2 (hf-ddp,
#                                       # hf-fsdp: asked by name), each recorded and profiled, held against its
#                                       # kernels by bench/attach_check.py; the Trainer's final parameters
#                                       # held bit for bit against its unwatched run's; each Trainer evaluates
#                                       # after step 10, a pause on CUDA events (its summary names step 11);
#                                       # ddp-fp16, ddp-powersgd (asked by name): a DDP with its own compression
#                                       # hook, whose all-reduces are timed as the hook issues them (ddp-fp16 also
#                                       # keeps an average of the weights in watch.computing: CUDA events);
#                                       # ddp-zero (by name): torch's ZeroRedundancyOptimizer, its asynchronous
#                                       # broadcasts timed as the loop's and its waits blocked time (these three first
#                                       # on NCCL 2026-11-29: about 200 s together); ddp-experts (by name): a
#                                       # mixture of experts' all-to-alls timed inside the forward (8 of 8 on an H200, 2026-11-29)
#   bash bench/gpu_session.sh memory    # bench/memory_staircase.py --step-peak on the GPU, 2 ranks sharing it, at
#                                       # 25 and 1 MB: what each strategy holds and what sets its step's peak
#   bash bench/gpu_session.sh overhead  # bench/overhead.py at the doctor's training shape for what the doctor does not
#                                       # run: attach on a user's DDP and on FSDP2 (issue 12's goal, <= 1.02)
#   bash bench/gpu_session.sh overhead memory   # modes run one after another in one call (not attach: it takes runs)
#
# A lent GPU's first call: `bash bench/gpu_wheels.sh` here, then `doctor` (290-340 s on an H200), then
# `overhead`, `attach ddp-zero ddp-powersgd ddp-fp16` and `memory` fitted one call of 404 s (2026-11-29), and
# `attach ddp-experts ddp-powersgd`, `memory`, `attach hf-ddp hf-fsdp` one of 289 s (the next lease), each with
# carry [".whl"]; name OUT elsewhere and tar it into the device's $OUT: it brings back 8 files at most.
# The machine has torch but not every package ddpwatch needs: wheels carried in .whl/ (pyzmq, datasets,
# dill, multiprocess for Python 3.12; bench/gpu_wheels.sh makes them here) are installed into /tmp/site first. Logs go to $OUT (the device
# tool's folder that comes back), or /tmp/gpu-session elsewhere.
set -u
usage="usage: bash bench/gpu_session.sh doctor | attach [fsdp2] [hsdp] [ddp-compiled] [hf-ddp] [hf-fsdp] [ddp-fp16] [ddp-powersgd] [ddp-zero] [ddp-experts] | memory | overhead (several of doctor, memory, overhead: in turn)"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
if [ "$1" != attach ]; then
    for mode in "$@"; do
        case $mode in doctor|memory|overhead) ;; *) echo "gpu_session: unknown mode $mode; $usage" >&2; exit 2 ;; esac
    done
fi
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1

python3 - <<'EOF' | tee "$OUT/machine.txt"
import time, torch, torch.distributed as dist
start = time.perf_counter(); total = 0
for i in range(10**6):
    total += i
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}; host: 10^6 additions in {1e3 * (time.perf_counter() - start):.0f} ms")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.draw --format=csv | tee -a "$OUT/machine.txt"

# torchrun with each local rank its own NCCL host, so ranks can share one GPU (what train.py's gpu_sharing_env does;
# the examples are a user's plain scripts and do not). AS_LOCAL_RANK_0=1: each rank is also told it is local rank 0,
# for Accelerate, whose DDP is given device_ids=[LOCAL_RANK] (cuda:1 on a one-GPU machine: an IndexError in DDP's forward)
shared() {
    local ranks=$1; shift
    python3 -m torch.distributed.run --standalone --nproc_per_node="$ranks" --no-python bash -c \
        'exec env NCCL_HOSTID=ddpwatch-local-rank-$LOCAL_RANK NCCL_SOCKET_IFNAME=lo ${AS_LOCAL_RANK_0:+LOCAL_RANK=0} python3 "$@"' _ "$@"
}

# attached LABEL RANKS SCRIPT ARGS...: recorded and profiled, then the same loop unwatched, then the check.
# SAVES_FINAL=1: each run's rank 0 saves the final parameters (the example's --save-final), compared bit for bit
attached() {
    local label=$1 ranks=$2; shift 2
    local dir=/tmp/gpu-session/$label port=$((5700 + RANDOM % 200))
    local watched_final=${SAVES_FINAL:+--save-final $dir/watched.pt} unwatched_final=${SAVES_FINAL:+--save-final $dir/unwatched.pt}
    rm -rf "$dir"; mkdir -p "$dir"
    python3 -m ddpwatch record --listen "tcp://127.0.0.1:$port" --out "$dir/session" --idle-exit 8 --wait 200 > "$dir/record.log" 2>&1 &
    local recorder=$!
    echo "== $label: $ranks ranks, watched"
    timeout 150 bash -c "$(declare -f shared); shared $ranks $* --watch tcp://127.0.0.1:$port --profile $dir/profile $watched_final" \
        > "$OUT/$label.log" 2>&1 || echo "$label: the watched run failed: $(tail -3 "$OUT/$label.log")"
    wait "$recorder"
    echo "== $label: $ranks ranks, unwatched"
    timeout 150 bash -c "$(declare -f shared); shared $ranks $* --no-watch --profile $dir/unwatched $unwatched_final" \
        > "$dir/unwatched.log" 2>&1 || echo "$label: the unwatched run failed: $(tail -3 "$dir/unwatched.log")"
    grep -h -i -E 'bucket\(s\)|unit\(s\)|error|Traceback' "$OUT/$label.log" | head -5
    python3 bench/attach_check.py "$dir/session" "$dir/profile" --unwatched "$dir/unwatched" --label "$label" --sharing --steps \
        2>&1 | tee "$OUT/$label-check.txt" | grep -v '^[0-9]'
    [ -n "${SAVES_FINAL:-}" ] && python3 - "$dir/watched.pt" "$dir/unwatched.pt" <<'EOF' 2>&1 | tee "$OUT/$label-final.txt"
import sys, torch
watched, unwatched = (torch.load(path, map_location="cpu") for path in sys.argv[1:3])
differ = sorted(name for name in unwatched.keys() | watched.keys()
                if name not in watched or name not in unwatched or not torch.equal(watched[name], unwatched[name]))
print(f"final parameters, watched against unwatched: {len(unwatched)} tensors, "
      + (f"{len(differ)} differ ({', '.join(differ[:4])})" if differ else "bit for bit equal"))
EOF
    python3 -m ddpwatch summary "$dir/session" > "$OUT/$label-summary.md" 2>&1
    grep -E '^\| [a-z]|^- segment' "$OUT/$label-summary.md"
}

if [ "$1" != attach ]; then
    for mode in "$@"; do
        case $mode in
        doctor)
            timeout 420 python3 -m ddpwatch doctor 2>&1 | tee "$OUT/doctor.txt"
            ;;
        overhead)  # the doctor's training shape (GPU-bound, as a user's step is), 40 steps a mode as on the H100
            timeout 300 python3 bench/overhead.py --device cuda --ranks 1 --model small --micro-batch 64 --seq-len 512 \
                --steps 40 --strategies attach,attach-fsdp 2>&1 | tee "$OUT/overhead.txt"
            ;;
        memory)  # train.py's rule (init_distributed) lets the two ranks share the GPU
            for cap in 25 1; do
                timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/memory_staircase.py --device cuda \
                    --hidden 768 --layers 12 --bucket-mb "$cap" --step-peak 2>&1 | grep -v -E '^(W|\[W)[0-9]' | tee "$OUT/memory-$cap-mb.txt"
            done
            ;;
        esac
    done
    exit 0
fi
# attach [fsdp2] [hsdp] [ddp-compiled] [hf-ddp] [hf-fsdp] [ddp-fp16] [ddp-powersgd] [ddp-zero] [ddp-experts]: the first three when none is named
runs=("${@:2}"); [ ${#runs[@]} -eq 0 ] && runs=(fsdp2 hsdp ddp-compiled)
for run in "${runs[@]}"; do
    case $run in
    fsdp2) attached fsdp2 2 examples/plain_fsdp.py --steps 10 --width 2048 --layers 8 --batch-size 512 ;;
    hsdp) attached hsdp 4 examples/plain_fsdp.py --steps 10 --width 2048 --layers 8 --batch-size 256 --replicas 2 ;;
    ddp-compiled) attached ddp-compiled 2 examples/plain_ddp.py --steps 12 --width 2048 --layers 8 --batch-size 512 --compile inductor ;;
    hf-ddp) AS_LOCAL_RANK_0=1 SAVES_FINAL=1 attached hf-ddp 2 examples/hf_trainer.py --steps 12 --batch-size 64 --eval-every 10 ;;
    hf-fsdp) SAVES_FINAL=1 attached hf-fsdp 2 examples/hf_trainer.py --steps 12 --batch-size 64 --fsdp --eval-every 10 ;;
    ddp-fp16) SAVES_FINAL=1 attached ddp-fp16 2 examples/plain_ddp.py --steps 20 --width 2048 --layers 8 --batch-size 512 --comm-hook fp16 \
        --ema 0.999 ;;
    ddp-powersgd) SAVES_FINAL=1 attached ddp-powersgd 2 examples/plain_ddp.py --steps 20 --width 2048 --layers 8 --batch-size 512 \
        --comm-hook powersgd ;;
    ddp-zero) SAVES_FINAL=1 attached ddp-zero 2 examples/plain_ddp.py --steps 20 --width 2048 --layers 8 --batch-size 512 --zero ;;
    ddp-experts) SAVES_FINAL=1 attached ddp-experts 2 examples/plain_ddp.py --steps 20 --width 2048 --layers 8 --batch-size 512 \
        --experts ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
    esac
done
