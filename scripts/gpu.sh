#!/usr/bin/env bash
# The one script for the GPU machine (run through the `device` tool, carrying .whl):
#   bash scripts/gpu.sh [stage ...]      stages: build test sm80 kernels e2e chat gptq awq generate serve attention
#                                        realmodel demo benchmark
#                                        (realmodel, demo, benchmark and test_real_model.py's GPU test need SmolLM2's GGUF
#                                        in $LITQUANT_CACHE and Debian's jargon.txt.gz in /usr/share/doc/jargon-text,
#                                        which the GPU machine cannot fetch; how they were carried there:
#                                        benchmarks/results/2026-12-04-real-model-generate.md)
#                                        (sm80: the marlin GPU tests on the Ampere build, LITQUANT_CUDA_ARCH=8.0)
#                                        (default: build test kernels)
# Installs the carried wheels, then runs each stage with its log (and JSON) under $OUT. LitServe and its dependencies
# (the serve tests and stage) are not on the GPU machine either; to carry them in .whl/serve:
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 -d .whl/serve litserve httpx
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl/serve/*.whl 2>/dev/null) \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/litquant-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

run() {  # run <stage> <command...>: log the exact command and its output to $OUT/<stage>.log
  local stage=$1; shift
  { echo "\$ $*"; date -u; } > "$OUT/$stage.log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$stage.log"
  local rc=${PIPESTATUS[0]}
  echo "[$stage] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$stage.log" "$OUT/summary.txt"
}

stages=${*:-build test kernels}
for stage in $stages; do
  case $stage in
    build)   run build python3 -m litquant kernels --build true ;;
    test)    run test python3 -m pytest -m gpu -q --no-header -p no:cacheprovider ${TEST_ARGS:-tests} ;;
    sm80)    run sm80 env LITQUANT_CUDA_ARCH=8.0 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider \
               ${SM80_TEST_ARGS:-tests/test_marlin.py} ;;
    kernels) run kernels python3 benchmarks/kernels.py --out-dir "$OUT" ${KERNELS_ARGS:-} ;;
    e2e)     run e2e python3 benchmarks/e2e_decode.py --out_dir "$OUT" ${E2E_ARGS:-} ;;
    chat)    for prompt in 16 3000; do  # chat's 4096-position cache: litgpt's SDPA against FlexAttention
               run chat$prompt python3 benchmarks/e2e_decode.py --out_dir "$OUT/chat$prompt" --compile yes --cache 4096 \
                 --attention both --tokens 100 --prompt $prompt ${CHAT_ARGS:---variants marlin}
             done ;;
    gptq)    run gptq python3 benchmarks/quantize_speed.py --out_dir "$OUT" ${GPTQ_ARGS:-} ;;
    awq)     run awq python3 benchmarks/awq_speed.py --out "$OUT/awq_speed.json" ${AWQ_ARGS:-} ;;
    generate) run generate python3 benchmarks/generate_speed.py --out "$OUT/generate_speed.json" ${GENERATE_ARGS:-} ;;
    serve)   run serve python3 benchmarks/serve_speed.py --out "$OUT/serve_speed.json" ${SERVE_ARGS:-} ;;
    attention) run attention python3 benchmarks/decode_attention.py ${ATTENTION_ARGS:---e2e} ;;
    realmodel) run realmodel python3 benchmarks/real_model_generate.py "$OUT" ${REALMODEL_ARGS:-} ;;
    demo)    run demo python3 -m litquant demo ;;
    benchmark) run benchmark python3 -m litquant benchmark --out_dir /tmp/litquant-benchmark ${BENCHMARK_ARGS:-}
               cp /tmp/litquant-benchmark/benchmark.json /tmp/litquant-benchmark/benchmark.md "$OUT/" ;;  # not the checkpoints
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
