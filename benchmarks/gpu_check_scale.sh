#!/usr/bin/env bash
# The GPU checks of issue 47 that the CPU machine cannot run, as one script for a GPU session
# (recursa has only been tested on CPU processes over gloo; see docs/scale.md, "What has run where").
#
#   bash benchmarks/gpu_check.sh scale [OUT_DIR]   (or this file directly) # one GPU is enough for 1-3; 4 needs two GPUs
#
# 1. bf16 autocast and activation checkpointing on a GPU: benchmarks/precision.py on cuda (the log-prob
#    gap bf16 vs fp32 on the embedded model, s/step and memory ratios).
# 2. The precision tests on a GPU (RECURSA_DEVICE=cuda).
# 3. A tiny GRPO run with train.precision = bf16 and checkpointing on the GPU.
# 4. With two GPUs: the FSDP2 learner under torchrun over NCCL, against the one-process run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA in this torch'; print(torch.__version__, torch.cuda.get_device_name(0))"

echo "== 1. precision benchmark on cuda"
RECURSA_DEVICE=cuda $PY benchmarks/precision.py --device cuda --rows 8 --tokens 240 --repeats 5 --out "$OUT/precision_cuda.json"

echo "== 2. precision tests on cuda"
RECURSA_DEVICE=cuda $PY -m pytest -q tests/test_precision.py 2>&1 | tail -3 | tee "$OUT/test_precision.txt"

echo "== 3. a bf16 + checkpointing GRPO run on the GPU"
SETS=(--set model.name=tiny-random --set env.name=arithmetic --set train.steps=3 --set train.prompts_per_step=4 --set train.group_size=4
      --set sampling.max_new_tokens=16 --set eval.n=8 --set model.device=cuda)
$PY -m recursa.cli train examples/smoke.toml "${SETS[@]}" --set train.precision=bf16 --set train.activation_checkpointing=true \
    --set train.shared_prefix=false --out "$OUT/grpo_bf16_ckpt" --overwrite

NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  echo "== 4. FSDP2 learner on 2 GPUs (NCCL) against one process"
  $PY -m recursa.cli train examples/smoke.toml "${SETS[@]}" --set model.device=cuda --out "$OUT/one" --overwrite
  $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m recursa.cli train examples/smoke.toml "${SETS[@]}" --set model.device=cuda \
      --set learner.backend=fsdp --out "$OUT/fsdp2" --overwrite
  $PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
rows = lambda run: [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if "loss/policy" in l]
for a, b in zip(rows("one"), rows("fsdp2")):
    print(a["step"], "grad_norm", a["policy/grad_norm"], b["policy/grad_norm"], "reward", a.get("reward/mean"), b.get("reward/mean"))
PYEOF
else
  echo "== 4. skipped: FSDP2 over NCCL needs 2 GPUs, this machine has $NGPU"
fi
echo "done: $OUT"
