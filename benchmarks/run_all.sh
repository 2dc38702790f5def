#!/usr/bin/env bash
# Every benchmark on one machine with 2 GPUs, in one go, appending to RESULTS (default
# benchmarks/RESULTS.md). Usage: benchmarks/run_all.sh [RESULTS] [LOGDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=${1:-benchmarks/RESULTS.md}
L=${2:-/tmp/lightning_ep_bench}
mkdir -p "$L"
T="python3 -m torch.distributed.run --nproc-per-node 2"
S="benchmarks/bench_step.py --record --results $R"
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" >>"$L/$name.log" 2>&1; echo "exit $?"; }

run layer 200 $T benchmarks/bench_layer.py --shapes coarse fine shared --warmup 3 --iters 10 --record --results "$R"
for shape in coarse fine; do
  run "step_${shape}" 360 $T $S --shape $shape --profile \
    --rows grouped_mm grouped_mm+compile ep:a2a ep:a2a+compile ep:a2a@reference ep:allgather+compile eager
  run extra 150 $T $S --shape $shape --rows hf_ep
  run extra 100 env CUDA_VISIBLE_DEVICES=0 python3 $S --shape $shape --rows ep:a2a+compile grouped_mm
done
for shape in coarse fine; do  # 4 sequences per GPU: the GPU-bound steps
  run "step4_${shape}" 300 $T $S --shape $shape --batch 4 --rows grouped_mm grouped_mm+compile ep:a2a+compile ep:a2a+compile+dedup
done
run experts 150 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_experts.py --experts 4 --rows 512 4096 \
  --record --results "$R"
grep -hE "^(coarse|fine|shared) " "$L/layer.log"
grep -hE "^\| \(|^\| row" "$L"/step_*.log "$L"/step4_*.log "$L"/extra.log
grep -hE "^\| " "$L/experts.log"
