#!/usr/bin/env bash
# Issue #32's multi-GPU runs on one 4-GPU machine (nvidia-h200-x4 / nvidia-h100-x4), one device call each:
#
#   bash benchmarks/run_multi.sh CALL        # CALL = 1, 2 or 3
#
#   1  two lanes of two GPUs at once: lane A (GPUs 0,1) compile.py --gpus 2 (ddp, zero3, fsdp; eager and
#      compiled); lane B (GPUs 2,3) tp.py --gpus 2 (GPT-1.3B and the Llama-3-8B shape at tp 2), moe.py at EP 2
#      (8 experts) against dense, pipeline.py at pp 2 (1F1B, M = 4, 8, 16) against zero1 and zero3.
#   2  compile.py --gpus 4 (the same six configurations on all four GPUs).
#   3  tp.py --gpus 4 at tp 4 and at dp 2 x tp 2, moe.py at EP 4, pipeline.py at pp 4 and pp 2 x dp 2.
#   4  MoE at EP 2 and pipeline at pp 2 on GPUs 0,1 (call 1's lane B after tp.py).
#   5  the TP, pipeline x TP, MoE and pipeline parity suites over NCCL (LZ_TEST_ACCELERATOR=gpu), a log per suite.
#
# Lanes share the host (64 cores) and nothing else: every ratio is taken between configurations of the
# same lane, run one after another, so both sides of a ratio see the same neighbour. What comes back in
# $OUT: setup.log, one log per lane, summary.md (every table) and details.tgz (per-configuration logs).
# Carry .whl/ (../shared/tools/device_wheels.sh) for hydra-core and omegaconf.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lz_out}
CALL=${1:?usage: run_multi.sh 1|2|3}
BUDGET=${LZ_BUDGET_S:-550}
START=$SECONDS
mkdir -p "$OUT" runs
left() { echo $(( BUDGET - (SECONDS - START) )); }

{
  echo "=== call $CALL, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), tree $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && echo "installed $(ls .whl | wc -l) wheels"
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -8
  nproc; free -g | head -2
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
} > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node"  # a command, so `timeout` can run it

lane_compile() {  # $1 = GPU count
  python3 benchmarks/compile.py --gpus "$1" --budget-s $(( $(left) - 15 ))
}

moe_pair() {  # $1 = GPUs = EP degree
  for cfg in moe dense; do
    timeout 150 $TORCHRUN "$1" benchmarks/moe.py --config "$cfg" --ep "$1" --steps 15 --warmup 5 > "$OUT/moe.tmp" 2>&1 \
      && grep '^{' "$OUT/moe.tmp" || { echo "moe $cfg EP $1: failed"; tail -n 5 "$OUT/moe.tmp"; }
  done
}

pipe() {  # $1 = GPUs, $2 = stages, $3 = configs
  timeout "${4:-240}" $TORCHRUN "$1" benchmarks/pipeline.py --stages "$2" --configs "$3" --steps 10 --warmup 3 2>&1 \
    | sed -n '/^### Pipeline/,$p'
}

case "$CALL" in
  1)
    # The Llama-3-8B shape at tp 2 over one replica holds ~64 GB of model state per GPU: full depth on an
    # H200, 16 of its 32 layers on an 80 GB H100 (said in the table's header).
    LL=""; (( GPU_MIB < 100000 )) && LL="--llama-layers 16"
    ( export CUDA_VISIBLE_DEVICES=0,1; lane_compile 2 ) > "$OUT/laneA.log" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=2,3
      python3 benchmarks/tp.py --gpus 2 --budget-s 260 $LL
      echo "### MoE EP 2 (8 experts) vs dense, zero2"; moe_pair 2
      pipe 2 2 zero1,zero3,pipe-M4,pipe-M8,pipe-M16 $(( $(left) - 10 ))
    ) > "$OUT/laneB.log" 2>&1 &
    wait
    ;;
  2)
    lane_compile 4 > "$OUT/laneA.log" 2>&1
    ;;
  4)  # call 1's lane B after its tp.py (MoE EP 2, pipeline pp 2), beside call 3's MoE EP... on GPUs 0,1
    ( export CUDA_VISIBLE_DEVICES=0,1
      echo "### MoE EP 2 (8 experts) vs dense, zero2"; moe_pair 2
      pipe 2 2 zero1,zero3,pipe-M4,pipe-M8,pipe-M16 $(( $(left) - 10 ))
    ) > "$OUT/laneA.log" 2>&1
    ;;
  5)  # the parity suites over NCCL (tests/distributed/test_nccl.py's suites), one log per suite; with fewer
      # than four GPUs only the two-rank tests (four ranks would put two on one GPU, which NCCL refuses).
      # The pipeline suite's fixture trains eleven configurations in one torchrun: when it fails, each runs
      # alone under tests/helpers/hang_dump.py, so a configuration that fails or hangs names itself and its stacks.
    NG=$(nvidia-smi -L | wc -l)  # with fewer than four GPUs the four-rank fixtures skip (skip_without_gpus)
    for suite in tests/parallel/test_tp_parity.py tests/parallel/test_pp_tp_parity.py \
                 tests/moe/test_zero_expert_parallel.py tests/pipeline/test_pipeline_parity.py; do
      (( $(left) < 60 )) && { echo "$suite: not run (budget)" >> "$OUT/laneA.log"; continue; }
      [[ $NG -lt 4 && $suite == *pp_tp* ]] && { echo "$suite: four ranks only, not run" >> "$OUT/laneA.log"; continue; }
      cap=$(( $(left) - 30 )); (( cap > 150 )) && cap=150
      LZ_TEST_ACCELERATOR=gpu timeout -s INT $cap python3 -m pytest -v -x -p no:cacheprovider \
        "$suite" > "$OUT/nccl_$(basename "$suite" .py).log" 2>&1
      echo "$suite: exit $? ($(tail -n 1 "$OUT/nccl_$(basename "$suite" .py).log"))" >> "$OUT/laneA.log"
    done
    if ! grep -q "test_pipeline_parity.py: exit 0" "$OUT/laneA.log"; then  # name the configuration that fails
      for cfg in "p2_1f1b=stages=2,schedule=1f1b,micro=4,ckpt=1" "p2_gpipe=stages=2,schedule=gpipe,micro=4,ckpt=1,fmt=full" \
                 "p2_uneven=stages=2,schedule=1f1b,micro=2,blocks=5" \
                 "p2_interleaved=stages=2,schedule=interleaved,virtual=2,micro=4,ckpt_interval=1" \
                 "p2_zero0_accum=stages=2,stage=0,micro=2,accumulate=2,steps=10,partition=uniform" \
                 "p2_resume=stages=2,micro=4,resume=1" "p2_resume_p1=stages=2,micro=4,resume=1,resume_stages=1" \
                 "p1_zero2=stages=1,stage=2" "p2_bf16=stages=2,precision=bf16-mixed,steps=10"; do
        (( $(left) < 120 )) && break
        mkdir -p /tmp/pipe_one
        python3 -c 'import json, sys; n, _, s = sys.argv[1].partition("="); print(json.dumps({"runs": {n: s}}))' \
          "$cfg" > /tmp/pipe_one/params.json
        LZ_TEST_ACCELERATOR=gpu LZ_HANG_DUMP_S=50 timeout 70 $TORCHRUN 2 tests/helpers/hang_dump.py \
          -m tests.helpers.run_scenario pipeline.pipe /tmp/pipe_one/params.json /tmp/pipe_one \
          > "$OUT/pipe_${cfg%%=*}.log" 2>&1
        echo "pipeline ${cfg%%=*}: exit $?" >> "$OUT/laneA.log"
      done
    fi
    ;;
  3)
    (
      python3 benchmarks/tp.py --gpus 4 --tp 4 --budget-s 200
      python3 benchmarks/tp.py --gpus 4 --tp 2 --configs gpt_zero,gpt_mps --budget-s 110
      echo "### MoE EP 4 (8 experts) vs dense, zero2"; moe_pair 4
      pipe 4 4 zero3,pipe-M4,pipe-M8,pipe-M16 $(( $(left) - 10 ))
    ) > "$OUT/laneA.log" 2>&1
    ;;
esac

{
  for f in "$OUT"/lane*.log; do
    echo "## $(basename "$f")"
    grep -v -E 'LeafSpec|litlogger|UserWarning|warnings.warn|^\s*$' "$f" | grep -E '^(\||#|\{|Llama|Global|moe|!!!|Error|.*Traceback)' || true
  done
} > "$OUT/summary.md"
rm -f "$OUT/moe.tmp"; tar czf "$OUT/details.tgz" runs 2>/dev/null
cat "$OUT/summary.md"
