#!/usr/bin/env bash
# A/B of two trees on one GPU machine in one call (issue #29: "re-measured on the new code in the same run as
# the old tree"): the tree carried in .oldtree/ (made here with `git archive OLD | tar -x -C .oldtree`) against
# this checkout, each section run old then new, back to back, with the same arguments.
#
#   bash benchmarks/ab_trees.sh SECTION ...     sections: peers2 (2 GPUs), offload (1 GPU)
#
# peers2: ddp, zero1, zero2, zero3 and fsdp on GPT-1.3B mb 8, 2 GPUs (AB_PEERS_ARGS overrides);
# offload: zero2_offload and zero3_offload on GPT-1.3B mb 16, 1 GPU (AB_OFFLOAD_ARGS overrides).
# Logs and tables go to $OUT/ab_<section>_<tree>.log; LZ_BUDGET_S (default 560) bounds the call.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lz_out}; mkdir -p "$OUT"
BUDGET=${LZ_BUDGET_S:-560}; START=$SECONDS
ROOT=$PWD
left() { echo $(( BUDGET - (SECONDS - START) )); }
[[ -d .oldtree/lightning_zero ]] || { echo "!!! no .oldtree/ carried"; exit 2; }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
{ echo "=== $(date -u '+%Y-%m-%d %H:%M:%S UTC')"; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__)';
  echo "old tree: $(cat .oldtree/COMMIT 2>/dev/null)"; echo "new tree: $(git rev-parse HEAD 2>/dev/null || cat COMMIT)"; } \
  > "$OUT/ab_setup.log" 2>&1
# each tree builds (or finds) its own CPU Adam under its own build root
for t in old new; do
  dir=$ROOT; [[ $t == old ]] && dir=$ROOT/.oldtree
  (cd "$dir" && LIGHTNING_ZERO_BUILD_DIR=/tmp/lz_ops_$t PYTHONPATH=/tmp/site:$dir python3 -m lightning_zero.ops build --ops cpu_adam) \
    >> "$OUT/ab_setup.log" 2>&1
done
run_tree() {  # $1 tree, $2 section, $3 budget
  local dir=$ROOT; [[ $1 == old ]] && dir=$ROOT/.oldtree
  local log="$OUT/ab_$2_$1.log"
  cd "$dir"
  export PYTHONPATH=/tmp/site:$dir LIGHTNING_ZERO_BUILD_DIR=/tmp/lz_ops_$1
  case $2 in
    peers2) timeout "$3" python3 benchmarks/peers.py --gpus 2 --out-dir "/tmp/lz_ab/peers2_$1" --budget-s $(( $3 - 10 )) \
              ${AB_PEERS_ARGS:---configs ddp,zero1,zero2,zero3,fsdp --steps 8 --warmup 3 --config-timeout-s 90} ;;
    offload) CUDA_VISIBLE_DEVICES=0 timeout "$3" python3 benchmarks/offload.py --out "/tmp/lz_ab/offload_$1" \
              ${AB_OFFLOAD_ARGS:---model gpt_1b --micro-batch 16 --configs zero2_offload,zero3_offload --steps 5 --warmup 2 --config-timeout-s 100} ;;
    *) echo "unknown section $2" ;;
  esac > "$log" 2>&1
  echo "rc=$? after $SECONDS s" >> "$log"
  cd "$ROOT"
}
n=$#; i=0
for s in "$@"; do
  share=$(( $(left) / (2 * (n - i)) ))
  run_tree old "$s" "$share"
  share=$(( $(left) / (2 * (n - i) - 1) ))
  run_tree new "$s" "$share"
  i=$(( i + 1 ))
done
tail -n 30 "$OUT"/ab_*.log
