#!/usr/bin/env bash
# Everything lightning_zero measures on a lent GPU machine, in one script (DESIGN.md section 9).
#
#   bash benchmarks/run_gpu.sh [SECTION ...]
#
# Sections (each logged to $OUT/<section>.log; a failing section never stops the next one):
#   ops       compiled ops: `python3 -m lightning_zero.ops build`, `... report`, benchmarks/ops.py
#   gputests  python3 -m pytest -q -m gpu tests
#   peers1    benchmarks/peers.py --gpus 1 (single, zero1/2/3, fsdp, deepspeed_stage_2/3)
#   peers2    benchmarks/peers.py --gpus 2 (ddp, zero1/2/3, fsdp, deepspeed_stage_2/3); needs 2 GPUs
#   peers2prof benchmarks/peers.py --gpus 2 --profile (ddp, zero2, zero3, fsdp; 3 warm-up + 8 timed steps,
#             then 3 profiled ones): adds the exposed / total communication column; needs 2 GPUs, ~3 min
#   lora      benchmarks/lora.py --gpus 2: LoRA r=16 on a frozen random-weight Llama-3-8B-shaped model, seq 2048,
#             micro-batch 2 per GPU (zero3, fsdp, fsdp_mixed, deepspeed_stage_3, ddp; each in its own torchrun);
#             needs 2 GPUs; budget min(section limit - 60 s, 480 s), so `LZ_BUDGET_S=540 bash benchmarks/run_gpu.sh lora`
#             ends within 9 minutes; DeepSpeed comes from the carried .whl/
#   ckpt      benchmarks/checkpoint.py --gpus 2: issue #13's checkpoint comparison on GPT-1.3B (save and load time,
#             peak extra memory, bytes on disk of zero3, zero3_async, fsdp, deepspeed_stage_3; each in its own
#             torchrun; checkpoints of ~16 GB under /tmp/lz_ckpt_bench, deleted as measured); needs 2 GPUs; budget
#             min(section limit - 60 s, 480 s), so `LZ_BUDGET_S=560 bash benchmarks/run_gpu.sh ckpt` ends within 560 s;
#             DeepSpeed comes from the carried .whl/
#   onebit    torchrun 2 procs benchmarks/onebit.py   (skipped while that file does not exist)
#   pipeline  torchrun 2 procs benchmarks/pipeline.py (skipped while that file does not exist)
#   offload   benchmarks/offload.py once per '|'-separated argument list in OFFLOAD_RUNS (default: the
#             zero2_offload workload, GPT-1.3B micro-batch 16), with the host's memory, disk and locked-
#             memory limits before and the kernel's out-of-memory reports after (the largest-model runs)
# Without sections: "ops gputests peers1" on a 1-GPU machine, "peers2 onebit pipeline" on 2+ GPUs.
#
# Run from the repository root with the wheels of ../shared/tools/device_wheels.sh --peers carried
# in .whl/ (hydra-core, omegaconf, DeepSpeed and its pure-Python needs). What comes back in $OUT
# (at most 8 files): one log per section, setup.log (machine, versions), RESULTS.new.md (the
# sections the benchmarks appended to benchmarks/RESULTS.md in this run: append it to the real one)
# and details.tgz (per-configuration logs and results.jsonl; re-render a table here with
# `python3 benchmarks/peers.py --from-results <dir>/peers1/results.jsonl`).
#
# Environment knobs: LZ_BUDGET_S (wall-clock budget of the whole script, default 570 s: the device
# tool's command limit is 600 s; sections that would overrun are cut, peers.py then skips the
# configurations that no longer fit and still prints its table), PEERS_ARGS (extra peers.py
# arguments, e.g. "--configs zero2,zero3 --steps 20"), PEERS_PROF_ARGS (extra/overriding arguments of
# peers2prof), LORA_ARGS (extra/overriding lora.py arguments, e.g. "--act-ckpt" or "--configs zero3,fsdp"),
# CKPT_ARGS (extra/overriding checkpoint.py arguments, e.g. "--saves 1" or "--configs zero3,zero3_async"),
# ONEBIT_ARGS, PIPELINE_ARGS.
set -u
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lz_out}
WORK=/tmp/lz_bench
BUDGET=${LZ_BUDGET_S:-570}
START=$SECONDS
rm -rf "$WORK"; mkdir -p "$OUT" "$WORK"  # a warm machine keeps /tmp: start clean
export OUT WORK

left() { echo $(( BUDGET - (SECONDS - START) )); }

setup() {
  echo "=== setup $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $PWD"
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && echo "installed $(ls .whl | wc -l) wheels into /tmp/site" || echo "!!! wheel install failed"
    export PYTHONPATH=/tmp/site:$PWD
  else
    echo "!!! no .whl/ carried: hydra-core, omegaconf and deepspeed are missing (carry .whl)"
    export PYTHONPATH=$PWD
  fi
  nvidia-smi
  nvidia-smi topo -m 2>/dev/null || true
  nvcc --version 2>/dev/null | tail -n 2
  python3 - <<'EOF'
import importlib.metadata as md
import platform

import torch

print(f"python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"{torch.cuda.device_count()} GPU(s): {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
for dist in ("lightning", "pytorch-lightning", "triton", "deepspeed", "hydra-core", "omegaconf", "pydantic",
             "typing_extensions", "tensorboard", "ninja"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist}: not installed")
EOF
  # DeepSpeed's JIT op builder rejects the machine's TORCH_CUDA_ARCH_LIST ("9.0a"); peers.py sets 9.0 for it.
  TORCH_CUDA_ARCH_LIST=9.0 timeout 120 python3 -c "import deepspeed, lightning_zero; print('import deepspeed', deepspeed.__version__, 'and lightning_zero', lightning_zero.__version__, 'OK')" 2>&1 | tail -n 3
}

section_ops() {
  python3 -m lightning_zero.ops build && python3 -m lightning_zero.ops report || return 1
  if [[ -f benchmarks/ops.py ]]; then python3 benchmarks/ops.py; else echo "benchmarks/ops.py missing: skipped"; fi
}

section_gputests() {
  python3 -m pytest -q -m gpu tests -p no:cacheprovider
}

_peers() {  # $1 = GPUs; the section's own time limit is in $SECTION_LIMIT
  # shellcheck disable=SC2086
  python3 benchmarks/peers.py --gpus "$1" --write-results --out-dir "$WORK/peers$1" \
    --budget-s $(( SECTION_LIMIT - 20 )) ${PEERS_ARGS:-}
}
section_peers1() { _peers 1; }
section_peers2() { _peers 2; }
section_peers2prof() {  # at most 240 s: 4 configurations of ~25-35 s each, plus profiling and its analysis
  local budget=$(( SECTION_LIMIT - 20 < 240 ? SECTION_LIMIT - 20 : 240 ))
  # shellcheck disable=SC2086
  python3 benchmarks/peers.py --gpus 2 --profile --configs ddp,zero2,zero3,fsdp --steps 8 --warmup 3 \
    --write-results --out-dir "$WORK/peers2prof" --config-timeout-s 120 --budget-s "$budget" ${PEERS_PROF_ARGS:-}
}

section_lora() {  # the whole 8B LoRA comparison; 60 s kept for a hung configuration's kill (peers.py: up to 50 s)
  local budget=$(( SECTION_LIMIT - 60 < 480 ? SECTION_LIMIT - 60 : 480 ))
  # shellcheck disable=SC2086
  python3 benchmarks/lora.py --gpus 2 --write-results --out-dir "$WORK/lora" --budget-s "$budget" ${LORA_ARGS:-}
}

section_ckpt() {  # the checkpoint comparison; 60 s kept for a hung configuration's kill (peers.py: up to 50 s)
  local budget=$(( SECTION_LIMIT - 60 < 480 ? SECTION_LIMIT - 60 : 480 ))
  df -h /tmp
  # shellcheck disable=SC2086
  python3 benchmarks/checkpoint.py --gpus 2 --write-results --out-dir "$WORK/ckpt" --budget-s "$budget" ${CKPT_ARGS:-}
}

_torchrun2() {  # $1 = script, rest = its arguments
  local script=$1; shift
  if [[ ! -f $script ]]; then echo "$script missing: skipped"; return 0; fi
  python3 -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2 "$script" "$@"
}
section_offload() {
  python3 -m lightning_zero.ops build --ops cpu_adam || return 1
  free -g; df -h /tmp "${LZ_NVME_PATH:-/tmp}"; echo "ulimit -l: $(ulimit -l)"; nproc
  local runs=${OFFLOAD_RUNS:---model gpt_1b --micro-batch 16 --configs zero2,zero2_offload,zero2_offload_dpu --steps 5 --warmup 3}
  local i=0 run
  IFS='|' read -ra all <<< "$runs"
  for run in "${all[@]}"; do
    i=$(( i + 1 ))
    echo "--- offload run $i: $run"
    # shellcheck disable=SC2086
    python3 benchmarks/offload.py $run --out "$WORK/offload$i"
    dmesg 2>/dev/null | grep -i -E "out of memory|oom-kill|killed process" | tail -n 5
  done
}
section_onebit() { _torchrun2 benchmarks/onebit.py ${ONEBIT_ARGS:-}; }
section_pipeline() { _torchrun2 benchmarks/pipeline.py ${PIPELINE_ARGS:-}; }

export -f section_offload section_ops section_gputests _peers section_peers1 section_peers2 section_peers2prof section_lora section_ckpt _torchrun2 section_onebit section_pipeline

STATUS=()
run_section() {
  local name=$1 limit
  limit=$(( $(left) - 10 ))
  if ! declare -F "section_$name" > /dev/null; then
    STATUS+=("$name: unknown section (valid: ops gputests peers1 peers2 peers2prof lora ckpt onebit pipeline offload)"); return
  fi
  if (( limit < 30 )); then
    echo "=== $name: skipped, $(left) s of the ${BUDGET} s budget left" | tee "$OUT/$name.log"
    STATUS+=("$name: skipped (budget)"); return
  fi
  if [[ $name == peers2 || $name == peers2prof || $name == lora || $name == ckpt || $name == onebit || $name == pipeline ]] && (( NGPUS < 2 )); then
    echo "=== $name: skipped, needs 2 GPUs, this machine has $NGPUS" | tee "$OUT/$name.log"
    STATUS+=("$name: skipped (needs 2 GPUs)"); return
  fi
  echo "=== $name (time limit ${limit} s) $(date -u +%H:%M:%S)"
  local t0=$SECONDS rc
  ( set -o pipefail; SECTION_LIMIT=$limit timeout -k 10 "$limit" bash -c "section_$name" 2>&1 | tee "$OUT/$name.log" )
  rc=$?
  (( rc == 124 )) && echo "!!! $name hit its time limit" | tee -a "$OUT/$name.log"
  STATUS+=("$name: rc=$rc in $(( SECONDS - t0 )) s")
}

results_before=$(stat -c %s benchmarks/RESULTS.md 2>/dev/null || echo 0)
setup 2>&1 | tee "$WORK/setup.log"
if [[ -d /tmp/site ]]; then export PYTHONPATH=/tmp/site:$PWD; else export PYTHONPATH=$PWD; fi
NGPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if (( $# == 0 )); then
  if (( NGPUS >= 2 )); then set -- peers2 onebit pipeline; else set -- ops gputests peers1; fi
fi
echo "sections: $* ($NGPUS GPU(s), budget ${BUDGET} s)"
for s in "$@"; do run_section "$s"; done

# Collect: what the benchmarks appended to RESULTS.md, the details, then the summary.
if [[ -f benchmarks/RESULTS.md ]] && (( $(stat -c %s benchmarks/RESULTS.md) > results_before )); then
  tail -c +$(( results_before + 1 )) benchmarks/RESULTS.md > "$OUT/RESULTS.new.md"
fi
{
  echo "=== summary ($(( SECONDS - START )) s)"
  printf '  %s\n' "${STATUS[@]}"
} | tee -a "$WORK/setup.log"
# At most 8 files come back: section logs, RESULTS.new.md, details.tgz, and setup.log if there is room.
n_files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
(( n_files <= 6 )) && cp "$WORK/setup.log" "$OUT/setup.log"
tar -czf "$OUT/details.tgz" -C "$WORK" . 2>/dev/null
[[ -f $OUT/RESULTS.new.md ]] && cat "$OUT/RESULTS.new.md"
ls -la "$OUT"
