#!/usr/bin/env bash
# Every GPU measurement in one call on a lent GPU, in priority order, each part
# time-boxed so a hang or an error costs only its own part:
#   1. bench/gpu.py: ceilings, cuDNN attention parity, the update step (three variants: the
#      default, remat_policy=everything, a 1 GiB LM-head chunk) and decode at B=256/512/1024
#      (2026-11: 38-40% of the HBM bound at 256/512 on an H100, rising with B);
#   2. bench/grpo_step.py: one GRPO iteration, rljax vs TRL GRPOTrainer on the same GPU,
#      bfloat16, SmolLM2-135M's trunk (byte vocabulary), 16 prompts x G=8 x 128 new tokens;
#   3. decode again with XLA's command buffers (CUDA graphs) extended to while loops.
#
#   bash bench/gpu_session.sh OUTDIR
#
# Wheels the GPU image lacks (ml_collections; trl, datasets, dill, multiprocess for TRL) are
# installed from .whl/ when present (bench/README.md, "GPU"); GSM8K prompts are read from
# $RLJAX_GSM8K (a folder holding train.jsonl; default data/gsm8k, docs/data.md). SMOKE=1 runs tiny shapes (a CPU
# check of the script; TRL_PY names an interpreter with TRL when python3 has none).
set -u
OUT=${1:-${OUT:-/tmp/rljax_gpu}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${SMOKE:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/rljax_site .whl/*.whl && export PYTHONPATH=/tmp/rljax_site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=$(command -v python3)
TRL_PY=${TRL_PY:-$PY}
if [ "${SMOKE:-0}" = 1 ]; then
  U="--preset tiny --batch 4 --seq 64 --matmul-n 256 --copy-gib 0.01"
  D="--preset tiny --prompt 16 --new 8 --matmul-n 256 --copy-gib 0.01"
  DB="4 8"; IMPL=xla
  G="--shapes tiny --prompts 2 --generations 2 --new-tokens 8"; T=(600 600 600)
else
  U="--batch 32 --seq 1024"; D="--prompt 256 --new 256"; DB="256 512 1024"; IMPL=cudnn
  G="--shapes smollm2 --prompts 16 --generations 8 --new-tokens 128"; T=(330 200 70)
fi
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
 $PY -c "import jax, flax, optax, transformers, torch; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" 2>&1
) | tee "$OUT/env.txt"

echo "== 1. update variants and decode"
timeout "${T[0]}" $PY bench/gpu.py $U $D --runs 3 --attention-impl $IMPL --decode-batch $DB \
  --update-variants "{\"attention_impl\": \"$IMPL\"}" \
    "{\"attention_impl\": \"$IMPL\", \"remat_policy\": \"everything\"}" \
    "{\"attention_impl\": \"$IMPL\", \"logits_chunk_elements\": 268435456}" \
  --out "$OUT/gpu.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/gpu.log"

echo "== 2. GRPO iteration vs TRL"
# The orchestrating process measures a matmul peak with JAX: without this it would hold 75% of
# the GPU's memory while the rljax worker and TRL run.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T[1]}" $PY bench/grpo_step.py $G --iters 2 --peers trl --trl-python "$TRL_PY" \
  --device gpu --dtype bfloat16 --no-scaling --no-warm --timeout 150 \
  --out "$OUT/grpo_step_gpu.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/grpo.log"

echo "== 3. decode with command buffers over while loops"
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL timeout "${T[2]}" \
  $PY bench/gpu.py $D --skip update --runs 3 --attention-impl $IMPL \
  --decode-batch ${DB##* } --out "$OUT/gpu_cmdbuf.json" 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/cmdbuf.log"
echo "== done"
