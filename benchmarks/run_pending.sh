#!/usr/bin/env bash
# The device runs still owed to issues #30-#33 after 2026-11-28's sessions, one device call each (<= 9.5 min):
#
#   bash benchmarks/run_pending.sh CALL          # carry .whl (hydra, omegaconf, torchao, deepspeed and its needs, einops)
#
#   A  (4 GPUs) #32: where zero3 loses 4% to compiled fsdp on the 8B shape (eager pair, profiled: exposed comm);
#      8B weak scaling at 2 GPUs (4 GPUs: the eager zero3 row of the same call).
#   B  (4 GPUs) #30: SP against DeepSpeed ALST again after the host-sync fixes (32K, 128K); #32: MoE EP 4 sorted and
#      capacity dispatch against dense; pipeline sweep (1F1B and interleaved, pp 2 and 4, M = 4, 8, 16).
#   C  (4 GPUs) #32 item 6: sharded checkpoints of the 8B shape, ours against fsdp's DCP and DeepSpeed's;
#      #33: ZeRO++ on NVLink at 4 ranks with the direct qgZ write, and the 2,000-step loss of qwZ+qgZ+hpZ.
#   D  (1 x H100: nvidia-h100-x1) #33: the largest model without offload, fp32 against 16-bit states;
#      #31: decode rows (int8/int4 Triton, fair HF static+compile peer); GPU-marked kernel tests.
#   E  (2 GPUs) #31: tp 2 batch-1 latency; 70B-shape ZeRO-Inference from host memory against Accelerate.
#
# Each writes its logs under $OUT. NVLink multicast stays off (the lent machines' rule).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lz_out}
CALL=${1:?usage: run_pending.sh A|B|C|D|E}
BUDGET=${LZ_BUDGET_S:-570}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
mkdir -p "$OUT"
{ date -u; git rev-parse --short HEAD 2>/dev/null
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && echo "installed $(ls .whl | wc -l) wheels"
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g | head -2; } > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
TR="python3 -m torch.distributed.run --standalone --nproc-per-node"
mark() { echo "$1 exit $2 at $((SECONDS - START)) s" >> "$OUT/setup.log"; }

case "$CALL" in
  A)
    python3 benchmarks/peers.py --gpus 4 --model gpt_8b --micro-batch 2 --configs zero3,fsdp --profile --steps 6 \
      --warmup 3 --budget-s 260 --out-dir "$OUT/eager8b" > "$OUT/eager8b.log" 2>&1; mark eager8b $?
    python3 benchmarks/peers.py --gpus 2 --model gpt_8b --micro-batch 2 --configs zero3 --steps 6 --warmup 3 \
      --budget-s $(( $(left) - 10 )) --out-dir "$OUT/weak8b_2" > "$OUT/weak8b_2.log" 2>&1; mark weak8b_2 $?
    ;;
  B)
    python3 -m lightning_zero.ops build > "$OUT/ops.log" 2>&1
    python3 benchmarks/sequence.py sp --gpus 4 --seq-lens 32K,128K --profile --config-timeout-s 200 --budget-s 330 \
      --out-dir "$OUT/sp" > "$OUT/sp.log" 2>&1; mark sp $?
    for d in sorted capacity; do
      timeout 100 $TR 4 benchmarks/moe.py --config moe --ep 4 --dispatch $d --steps 15 --warmup 5 > "$OUT/moe_$d.log" 2>&1
      mark "moe $d" $?
    done
    timeout 80 $TR 4 benchmarks/moe.py --config dense --ep 4 --steps 15 --warmup 5 > "$OUT/dense.log" 2>&1; mark dense $?
    timeout $(( $(left) - 5 )) $TR 4 benchmarks/pipeline.py --sweep --global-batch 64 --steps 8 --warmup 3 \
      > "$OUT/pipeline.log" 2>&1; mark pipeline $?
    ;;
  C)
    python3 benchmarks/checkpoint.py --gpus 4 --model gpt_8b --micro-batch 1 --saves 1 \
      --configs zero3,zero3_async,fsdp,deepspeed_stage_3 --budget-s 400 --ckpt-dir /tmp/lz_ckpt \
      > "$OUT/checkpoint.log" 2>&1; mark checkpoint $?
    timeout 150 $TR 4 benchmarks/zeropp.py --device cuda --model xl --hpz 2 --steps 10 --skip 3 \
      > "$OUT/zeropp_nvlink4.log" 2>&1; mark zeropp $?
    ;;
  D)
    python3 -m pytest -q -m gpu tests/inference tests/quant tests/states16 -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    mark gpu_tests $?
    python3 benchmarks/largest.py --configs zero3:20:24,zero3_bf16sr:38:42,zero3_bf16sr_g16:46:52 \
      --budget-s 240 > "$OUT/largest.log" 2>&1; mark largest $?
    timeout $(( $(left) - 5 )) python3 benchmarks/inference.py --peer-compile > "$OUT/inference.log" 2>&1; mark inference $?
    ;;
  E)
    timeout 240 $TR 2 benchmarks/inference.py --tp 2 > "$OUT/inference_tp2.log" 2>&1; mark tp2 $?
    timeout $(( $(left) - 5 )) python3 benchmarks/inference.py --offload --batch 16 --new-tokens 8 --peer-accelerate \
      --model llama_70b > "$OUT/inference_70b.log" 2>&1; mark offload70b $?
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
