#!/usr/bin/env bash
# The 2-GPU scaling measurements in one device call (all stages end inside TOTAL_S, default 555 s):
#   1. torch peers (DDP, FSDP2 on 2 then 1 GPU; torch NCCL bus bandwidth) - first, before JAX takes the GPUs
#   2. JAX collectives 1 MiB..4 GiB + the all-reduce variants (why psum trails torch), fitted hardware profile
#   3. bench_scaling with the time left: runs in RUNS order, each row streamed to $OUT as it lands
# Every stage runs under `timeout` (its whole process group is killed past the limit); logs, JSON and
# tables go to $OUT; a short summary prints last.
#     bash scripts/run_2gpu.sh
# Knobs (environment): TOTAL_S TORCH_S COLL_S RUNS MODEL_OVER (';' between --model-over groups)
#   TORCH_ARGS COLL_ARGS SCALING_ARGS SKIP_TORCH=1 SKIP_COLL=1 SKIP_SCALING=1
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0          # NVLink multicast stays off on these machines
export OUT="${OUT:-$PWD/out_2gpu}"
mkdir -p "$OUT"
PY=${PY:-python3}
PY_TORCH=${PY_TORCH:-$PY}
TOTAL_S=${TOTAL_S:-555}
TORCH_S=${TORCH_S:-190}
COLL_S=${COLL_S:-95}
# Context-parallel runs last: on 2 H200s (jax 0.11.2) XLA:GPU segfaulted compiling them, killing the stage.
RUNS=${RUNS:-llama3_1b:dp:1,llama3_1b:fsdp:2,llama3_1b:dp:2,llama3_1b:tp:2,llama3_1b:fsdp_tp:2,llama3_8b:fsdp:2,llama3_1b:zero2:2,llama3_1b:zero1:2,llama3_1b:fsdp_tp_sp:2,llama3_8b:fsdp_tp:2,llama3_1b:fsdp_cp:2,llama3_1b:cp_ring:2:32768,llama3_1b:cp_ring:2:65536}
# Best single-GPU setting measured (2026-11-30 sweep): cuDNN attention, remat save_dots_no_batch, unfused ops
# (58,847 tok/s at batch 4; no remat 52,924).
MODEL_OVER=${MODEL_OVER:-attention=cudnn,remat=save_dots_no_batch;llama3_8b:remat=save_dots_no_batch,per_device_batch=2;seq65536:remat=full}

left() { echo $(( TOTAL_S - SECONDS )); }
gpu_idle() {   # a stage killed by timeout must not leave a process on the GPUs for the next one
  for _ in $(seq 10); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "  GPU still busy: $(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader | tr '\n' ' ')"
}
stage() {      # stage NAME LIMIT_S CMD...: output to $OUT/NAME.log, status line to stdout and stages.txt
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 20 ]; then echo "$name: not run ($limit s left)" | tee -a "$OUT/stages.txt"; return; fi
  echo "== $name: limit ${limit}s, starts at ${SECONDS}s"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( SECONDS - t0 ))s$([ $rc = 124 ] && echo ' (timeout)')" | tee -a "$OUT/stages.txt"
  gpu_idle
}

{ date -Is; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  $PY -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|nvidia-nccl|jax)" ; env | grep -E "^(NCCL|XLA)_"; } \
  > "$OUT/env.txt" 2>&1

[ -z "${SKIP_TORCH:-}" ] && stage torch_peers "$TORCH_S" $PY_TORCH scripts/bench_scaling_torch.py \
  --gpus 2,1 --deadline-s $(( TORCH_S - 10 )) --phase-reserve-s 35 --out "$OUT/torch_peers.jsonl" ${TORCH_ARGS:-}

[ -z "${SKIP_COLL:-}" ] && stage collectives "$COLL_S" $PY scripts/bench_collectives.py --mesh data=-1 \
  --ops all-reduce,all-gather,reduce-scatter,all-to-all,ppermute --min-bytes 1MiB --max-bytes 4GiB \
  --variants base,multiprocess,nccl_proto_simple,xla_user_buffers,nccl_algo_ring,xla_symmetric_buffers,nccl_min_channels_32,xla_one_shot_kernel,nccl_algo_tree,combine_default,combine_off --variant-sizes 64MiB,1GiB \
  --sweep-timeout-s $(( COLL_S * 55 / 100 )) --total-s $(( COLL_S - 8 )) --variant-timeout-s 25 \
  --copy-axes fsdp,tensor,context,expert --out "$OUT/collectives.json" --markdown "$OUT/collectives.md" ${COLL_ARGS:-}

OVERS=()
IFS=';' read -ra groups <<< "$MODEL_OVER"
for g in "${groups[@]}"; do [ -n "$g" ] && OVERS+=(--model-over "$g"); done
HW=h200
[ -s "$OUT/collectives.json" ] && HW="$OUT/collectives.json"   # the planner priced on the links just measured
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}   # 8b fsdp: 64 GB of state per GPU
LIM=$(( $(left) - 10 ))
[ -z "${SKIP_SCALING:-}" ] && stage scaling "$LIM" $PY scripts/bench_scaling.py --runs "$RUNS" "${OVERS[@]}" --hardware "$HW" \
  --budget-s $(( LIM - 15 )) --first-run-s 60 ${SCALING_ARGS:-}

echo "== summary at ${SECONDS}s"
$PY - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def jl(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip().startswith("{")] if p.exists() else []
print("stages:", " | ".join((out / "stages.txt").read_text().split("\n")) if (out / "stages.txt").exists() else "-")
torch_rows, tput = jl("torch_peers.jsonl"), {}
for r in torch_rows:
    if r.get("event") == "start":
        print(f"torch {r.get('torch')} nccl {r.get('nccl')} transformers {r.get('transformers')} NVLS={r.get('NCCL_NVLS_ENABLE')}")
    elif "error" in r:
        print(f"torch {r.get('group')} {r.get('job')}: ERROR {r['error'][:160]}")
    elif r.get("job") == "collectives":
        for c in r["collectives"]:
            if c["bytes"] in (2**30, 4 * 2**30):
                print(f"torch {c['op']:<15} {c['bytes'] / 2**30:.0f} GiB: busbw {c['busbw_GBps']:.1f} GB/s (loop), "
                      f"{c['busbw_call_GBps']:.1f} (single call)")
    else:
        tput[(r["job"], r["gpus"])] = r["tokens_per_s_per_gpu"]
        print(f"torch {r['job']:<5} x{r['gpus']}: {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, step {r['step_ms']:.0f} ms, "
              f"peak {r['peak_mem_gib']:.1f} GiB, MFU(989) {100 * r['mfu_989']:.1f}%, warm-up {r['warmup_s']:.0f} s")
for m in ("ddp", "fsdp2"):
    if (m, 1) in tput and (m, 2) in tput:
        print(f"torch {m} scaling 1->2 GPUs: {100 * tput[(m, 2)] / tput[(m, 1)]:.0f}%")
cj = out / "collectives.json"
if cj.exists():
    prof = json.loads(cj.read_text())
    print(f"JAX collectives ({prof.get('device')}, jax {prof.get('jax')}) {prof.get('note', '')}")
    for r in prof.get("rows", []):
        if r["bytes"] in (2**20, 2**30, 4 * 2**30):
            print(f"  {r['op']:<15} {r['bytes'] / 2**20:>5.0f} MiB: busbw {r['busbw_GBps']:.1f} GB/s "
                  f"(single call {r['busbw_GBps'] * r['time_s'] / r['call_s']:.1f})")
    for axis, v in prof.get("axes", {}).items():
        print(f"  profile {axis}: alpha {v['alpha_s'] * 1e6:.1f} us, BW {v['bw_Bps'] / 1e9:.1f} GB/s ({v.get('fitted_on')})")
    for r in prof.get("variants", []):
        if "error" in r:
            print(f"  variant {r['variant']}: ERROR {r['error'][:150]}")
        elif r["bytes"] == 2**30 or r.get("op") == "combine":
            print(f"  variant {r['variant']:<26} {r.get('op', ''):<10} {r['bytes'] / 2**20:>5.0f} MiB {r['mode']:<9} "
                  f"{r['busbw_GBps']:.1f} GB/s{'  nccl ' + r['nccl'] if r.get('nccl') else ''}")
best = {}
for r in jl("bench_scaling.jsonl"):
    if "error" in r:
        print(f"scaling {r['run']}: {r['error'][:150]}")
        continue
    eff = f"{100 * r['eff']:.0f}%" if r.get("eff") else "-"
    plan = f"{r['plan_ms']:.0f}" if r.get("plan_ms") else "-"
    print(f"scaling {r['run']:<32} {r['tok_s_gpu']:>8,.0f} tok/s/GPU eff {eff:>4} MFU(989) {100 * r['mfu_989']:.1f}% "
          f"{r['gib']:.0f} GiB step {r['step_ms']:.0f} ms plan {plan} ms {r.get('note', '')}")
    if r["run"].startswith("llama3_1b") and " x2 seq 4096" in r["run"]:
        best = max(best, r, key=lambda x: x.get("tok_s_gpu", 0)) if best else r
if best:
    for m in ("ddp", "fsdp2"):
        if (m, 2) in tput:
            print(f"verdict: best meshlab x2 ({best['run']}) {best['tok_s_gpu']:,.0f} vs torch {m} x2 {tput[(m, 2)]:,.0f} "
                  f"tok/s/GPU = {best['tok_s_gpu'] / tput[(m, 2)]:.2f}x")
EOF
ls "$OUT"
