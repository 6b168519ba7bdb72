#!/usr/bin/env bash
# The GPU figures in one command on a GPU machine without network, Megatron or TE (see benchmarks/README.md).
#
#   bash benchmarks/gpu.sh wheels   # on a machine with pip and a package index: the wheelhouse .whl/ (~53 MiB)
#   bash benchmarks/gpu.sh rehearse # on a CPU machine: everything a GPU call runs but the GPU work (REHEARSE=cheap:
#                                   # no download, install or training; PYTHON: a Python 3.12 with torch)
#   bash benchmarks/gpu.sh run [STAGE ...]  # on the GPU machine, .whl beside the code: install, then the stages
#                                           # (default: the first planned call's): rotary tests attention vision
#                                           # train idle py:SCRIPT
#   bash benchmarks/gpu.sh limit STAGE ELAPSED  # that stage's limit after ELAPSED seconds of a run (0: skipped)
#   bash benchmarks/gpu.sh image-venv [DIR]  # on a CPU machine: .venv-image, the pinned stack with the image's torch
#
# `run` writes into $OUT (default .bench/gpu): log.txt (environment and every stage's output), gpu_tests.xml (the GPU
# tests' outcomes and the measurements they record), bench_rotary_gpu.json,
# bench_attention.json, bench_vision_gpu.json, bench_train.json, bench_idle.json, train_log.txt and profile.txt.
# Each stage has its own time limit (`stage_seconds`), so a failing stage still leaves the others' results.
# GPU_SECONDS (optional): the seconds the whole `run` may take (the device time left, less the transfers); each
# stage's limit is cut to what is left of it (`clipped_seconds`), and a stage with too little left is skipped, so a
# call that would outrun the device time still ends by itself and returns what it took.
set -uo pipefail
cd "$(dirname "$0")/.."

# What the GPU image (Python 3.12, torch 2.11, transformers 5.17) lacks for qvl's training path, found by importing
# the GPU tests and a training run under `python -X importtime` and keeping the distributions the image does not
# hold. Versions are the pinned stack's (launchers/requirements-*.txt). transformers is carried at the pinned 5.12.1
# (Megatron-Bridge 0.6.2 pins <= 5.12.1; the image's 5.17 is untested with its bridges), with the tokenizers it
# accepts (<= 0.23.0; the image has 0.23.2). Left out on purpose: botocore (tensorboard imports it only for S3),
# av (energon imports it only for video), nemo-run and its executors (launching, not training).
WHEELS=(
  megatron-core==0.19.2 megatron-bridge==0.6.2 megatron-energon==7.4.1 transformers==5.12.1 tokenizers==0.22.2
  nvidia-modelopt==0.47.0 pulp==3.3.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  omegaconf==2.3.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  webdataset==1.0.2 braceexpand==0.1.7 multi-storage-client==1.3.1 rapidyaml==0.15.2 xattr==1.3.0 cffi==2.1.1
  wcmatch==10.2.1 bracex==3.2.2 lark==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2
  google-api-core==2.44.0 google-auth==2.62.2 googleapis-common-protos==1.76.0 h2==4.4.1 hpack==4.2.0
  hyperframe==6.1.0 deprecation==2.1.0 filetype==1.2.0 toml==0.10.2 sniffio==1.3.1 wcwidth==0.9.4
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2  # the `fla` extra: Qwen3.5's GatedDeltaNet on CUDA
)
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)  # omegaconf's parser runtime: no wheel on PyPI, built here (pure Python)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
LIMIT_MIB=60  # what travels is capped at 64 MiB, the repository included
# The planned device calls, in order: each one `run` of these stages, under 9 minutes with the set-up and all of them
# under 13 (15 minutes of device time, a start included; `rehearse` checks both). Call 1 takes the training figures
# (six runs, most wanted first: benchmarks/train_variants.py), call 2 the vision rotary's bandwidth and every
# GPU-marked test.
CALLS=("train" "rotary tests")
SETUP_SECONDS=45  # install and environment probe before the stages (2026-11-26: ~30 s)

stage_seconds() {  # a stage's time limit, seconds (the environment overrides)
  case "$1" in
    rotary) echo "${BENCH_ROTARY_SECONDS:-60}" ;;
    tests) echo "${GPU_TESTS_SECONDS:-250}" ;;
    attention) echo "${BENCH_ATTENTION_SECONDS:-60}" ;;
    vision) echo "${BENCH_VISION_SECONDS:-120}" ;;
    train) echo "${BENCH_TRAIN_SECONDS:-380}" ;;
    idle) echo "${BENCH_IDLE_SECONDS:-420}" ;;
    py:*) echo "${PY_SECONDS:-90}" ;;
    *) echo "error: unknown stage '$1'; stages: rotary tests attention vision train idle py:SCRIPT" >&2; return 2 ;;
  esac
}
MARGIN_SECONDS=30  # kept back from GPU_SECONDS after each stage: a stage's kill grace (20 s), the copies, the return
MIN_STAGE_SECONDS=30  # a stage given less than this is skipped: too short to give a figure

clipped_seconds() {  # $1 stage, $2 seconds the run has taken: its limit within GPU_SECONDS, or 0 to skip it
  local limit left
  limit=$(stage_seconds "$1") || return 2
  [ -z "${GPU_SECONDS:-}" ] && { echo "$limit"; return; }
  if ! [[ "$GPU_SECONDS" =~ ^[0-9]+$ && "${2:-}" =~ ^[0-9]+$ ]]; then
    echo "error: GPU_SECONDS='$GPU_SECONDS' (elapsed '${2:-}') is not a whole number of seconds; give the device time left, e.g. GPU_SECONDS=540" >&2
    return 2
  fi
  left=$(( GPU_SECONDS - $2 - MARGIN_SECONDS ))
  if (( left < MIN_STAGE_SECONDS )); then echo 0; elif (( left < limit )); then echo "$left"; else echo "$limit"; fi
}

TRAIN_ARGS=${BENCH_TRAIN_ARGS:---model qwen2_5_vl_3b --profile --no-loader}
# The files with GPU tests (the rest import launch-side packages): the kernel tests first, then the
# flash-linear-attention ones (fla's kernels, its exact-fp32 settings, Qwen3.5-VL's parity with it, the census's
# count of its launches: their Triton kernels compile for a while), then the tiny graphed trainings of
# test_bench_train.py (two runs each; the train stage's real-shape runs capture the layers' and the HF tower's graphs
# already), so that a stage cut off by its limit loses those first.
gpu_test_files() { grep -rl --include='test_*.py' 'mark.gpu' tests | sort | awk '/test_bench_train/ {train = train $0 "\n"; next} /gated_delta|fla_tf32|linear_attention/ {fla = fla $0 "\n"; next} {print} END {printf "%s%s", fla, train}'; }

wheels() {
  local python=${PYTHON:-python3} platform_args=() spec
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  mkdir -p .whl
  for spec in "${WHEELS[@]}"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platform_args[@]}" -d .whl "$spec" || { echo "error: could not download $spec" >&2; exit 1; }
  done
  for spec in "${SDIST_ONLY[@]}"; do
    "$python" -m pip wheel -q --no-deps -w .whl "$spec" || { echo "error: could not build $spec" >&2; exit 1; }
  done
  local mib
  mib=$(du -sm .whl | cut -f1)
  echo "wheelhouse .whl: $(ls .whl | wc -l) wheels, ${mib} MiB"
  if (( mib > LIMIT_MIB )); then echo "error: .whl is ${mib} MiB, over ${LIMIT_MIB}; remove stale wheels" >&2; exit 1; fi
}

install_stack() {  # $1: scratch; the wheelhouse into $1/site (pip --no-index --no-deps --target), qvl as $1/src/qvl
  local scratch=$1 python=${PYTHON:-python3}
  [ -d .whl ] || { echo "error: no .whl/ here; run 'bash benchmarks/gpu.sh wheels' first and carry .whl" >&2; exit 1; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" \
    .whl/*.whl || { echo "error: installing the wheelhouse failed" >&2; exit 1; }
  # qvl itself: its folders are the subpackages of the `qvl` namespace (pyproject's package-dir), linked, not built.
  mkdir -p "$scratch/src/qvl"
  for d in $("$python" -c "import ast, re; print(*ast.literal_eval(re.search(r'LAYERS[^=]*= (\{[^}]*\})', open('foundation/__init__.py').read()).group(1)))"); do
    ln -sfn "$PWD/$d" "$scratch/src/qvl/$d"
  done
}

run() {
  # Stages, in the order given (default: the first planned call's). Each has its own time limit, so a failing or
  # slow stage still leaves the others' results; `rehearse` checks that a planned call ends inside 9 minutes.
  local out=${OUT:-.bench/gpu} scratch=${SCRATCH:-$(mktemp -d)} stage start=$SECONDS  # scratch: the installed stack, qvl, runs
  local site=$scratch/site src=$scratch/src train=$scratch/bench_train
  local stages=("$@")
  (( ${#stages[@]} )) || read -ra stages <<<"${CALLS[0]}"
  for stage in "${stages[@]}"; do clipped_seconds "$stage" 0 >/dev/null || exit 2; done
  mkdir -p "$out"
  install_stack "$scratch"
  export PYTHONPATH="$src:$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  local log="$out/log.txt"  # what each stage prints, in one file (at most 8 files come back from a device run)
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; nproc; } >"$log" 2>&1
  python3 - <<'EOF2' 2>&1 | tee -a "$log"
from importlib.metadata import version
import torch
from qvl.foundation.megatron import import_megatron_bridge
import_megatron_bridge()  # the shim: Megatron-Bridge imports transformer_engine unconditionally in one module
from qvl.kernels.varlen_attention import _varlen_kernel
print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda,
      *(f"{name} {version(name)}" for name in ("transformers", "megatron-core", "megatron-bridge", "megatron-energon")),
      "varlen kernel", _varlen_kernel() is not None, "keywords", sorted(_varlen_kernel()[1]) if _varlen_kernel() else None)
EOF2
  for stage in "${stages[@]}"; do
    local limit
    limit=$(clipped_seconds "$stage" $((SECONDS - start)))
    if (( limit == 0 )); then
      echo "== $stage skipped: $((SECONDS - start)) of GPU_SECONDS=$GPU_SECONDS taken, too little left" | tee -a "$log"
      continue
    fi
    echo "== $stage ($(date +%T), limit ${limit} s)" | tee -a "$log"
    case "$stage" in
      rotary)
        timeout "$limit" python3 -m benchmarks.bench_rotary_gpu --out "$out" ${BENCH_ROTARY_ARGS:-} 2>&1 | tail -n 20 \
          | tee -a "$log" ;;
      tests)
        # SIGINT at the limit: pytest stops as on Ctrl-C and still writes gpu_tests.xml with the tests that ran
        timeout -s INT -k 20 "$limit" python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider --junitxml "$out/gpu_tests.xml" \
          $(gpu_test_files) 2>&1 \
          | grep -vi "warn" | tail -n 150 | tee -a "$log" ;;
      attention)
        timeout "$limit" python3 -m benchmarks.bench_attention 2>&1 | tail -n 20 >>"$log"
        cp .bench/bench_attention.json "$out/" 2>/dev/null ;;
      vision)
        timeout "$limit" python3 -m benchmarks.bench_vision_gpu --out "$out" ${BENCH_VISION_ARGS:-} 2>&1 | tail -n 20 \
          | tee -a "$log" ;;
      train)  # bench_train.json is rewritten as each run ends: a run cut off by the limit loses only itself
        timeout "$limit" python3 -m benchmarks.bench_train --out "$train" $TRAIN_ARGS 2>&1 | tail -n 40 | tee -a "$log"
        pkill -f "benchmarks.bench_train" 2>/dev/null  # a training child left by the time limit would hold the GPU
        cp "$train"/bench_train.json "$out/" 2>/dev/null
        for f in "$train"/run-*/result.json; do echo "$f: $(cat "$f")"; done 2>/dev/null >>"$log"  # each run, as done
        for f in "$train"/run-*-packed/profile.txt; do [ -f "$f" ] && cat "$f"; done >"$out/profile.txt" 2>/dev/null
        tail -c 1000000 "$train"/train_log.txt >"$out/train_log.txt" 2>/dev/null ;;
      idle)  # one run at 2, 4, 6, 8 packs per step: timers, allocator counters, GPU busy and idle per step
        timeout "$limit" python3 -m benchmarks.bench_idle --out "$scratch/idle" ${BENCH_IDLE_ARGS:-} 2>&1 | tail -n 20 \
          | tee -a "$log"
        pkill -f "benchmarks.bench_train" 2>/dev/null
        cp "$scratch"/idle/bench_idle.json "$out/" 2>/dev/null ;;
      py:*)  # a diagnostic script, in the same environment
        timeout "$limit" python3 "${stage#py:}" 2>&1 | grep -v "warn" | tail -n 60 | tee -a "$log" ;;
    esac
  done
  ls -la "$out"
}

# The GPU image's torch (2.11, cu130) and the torchvision built for it: `image-venv` builds the pinned stack around them,
# so that the suite and the rehearsal run on CPU under the torch the device has.
IMAGE_TORCH=(torch==2.11.0 torchvision==0.26.0)
image_venv() {  # $1 (default .venv-image): the pinned stack and qvl with IMAGE_TORCH, as `make venv` installs them
  local venv=${1:-.venv-image} uv=$PWD/.venv/bin/uv overrides ok=0
  [ -x "$uv" ] || { echo "error: no $uv; run 'make venv' first (it installs uv)" >&2; exit 1; }
  overrides=$(mktemp)
  printf '%s\n' "${IMAGE_TORCH[@]}" >"$overrides"
  # the Makefile's own uv install (install-with-uv), IMAGE_TORCH overriding the pins (uv reads UV_OVERRIDE)
  "$uv" venv -q --seed --python .venv/bin/python3 "$venv" && ln -sf "$uv" "$venv/bin/uv" \
    && UV_OVERRIDE="$overrides" make --no-print-directory install-with-uv VENV="$venv" && ok=1
  rm -f "$overrides"
  (( ok )) || { echo "error: building $venv failed" >&2; exit 1; }
  echo "$venv: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'); run" \
    "'$venv/bin/python -m pytest -n 2' or 'PYTHON=$venv/bin/python bash benchmarks/gpu.sh rehearse'"
}

rehearse() {
  # On a CPU machine, what the planned calls run except the GPU work (benchmarks/gpu_rehearsal.py): the wheelhouse
  # (downloaded first where missing) within the size limit, installed into a scratch prefix as `run` installs it,
  # each stage's own command with its arguments at tiny shapes (imports logged against what the GPU image holds),
  # and the stage limits of each call under 9 minutes. REHEARSE=cheap: no download, install or training.
  local mode=${REHEARSE:-full} scratch=${SCRATCH:-} seconds=() stage call
  if [ -z "$scratch" ]; then scratch=$(mktemp -d); trap "rm -rf '$scratch'" EXIT; fi
  for call in "${CALLS[@]}"; do
    for stage in $call; do seconds+=("$stage=$(stage_seconds "$stage")") || exit 2; done
  done
  if [ "$mode" = full ]; then
    [ -d .whl ] || wheels
    install_stack "$scratch"
  fi
  "${PYTHON:-python3}" -m benchmarks.gpu_rehearsal --mode "$mode" --scratch "$scratch" --limit-mib "$LIMIT_MIB" \
    --setup-seconds "$SETUP_SECONDS" --seconds "${seconds[@]}" --calls "${CALLS[@]}" \
    --wheels "${WHEELS[@]}" "${SDIST_ONLY[@]}" --train-args "$TRAIN_ARGS" --whl "${WHL:-.whl}" --test-files $(gpu_test_files)
}

case "${1:-}" in
  wheels) wheels ;;
  limit) shift; clipped_seconds "$@" ;;  # a stage's limit after so many seconds of the run (GPU_SECONDS applied)
  run) shift; run "$@" ;;
  rehearse) rehearse ;;
  image-venv) shift; image_venv "$@" ;;
  *) echo "usage: bash benchmarks/gpu.sh wheels|rehearse|run|limit|image-venv   (see benchmarks/README.md)" >&2; exit 2 ;;
esac
