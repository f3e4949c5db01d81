#!/usr/bin/env bash
# Run rljax on a Cloud TPU pod slice: create the TPU VM, install rljax on every worker, start
# `rljax train` on every worker (SPMD: the same command everywhere), stream worker 0's log,
# stop, delete. See launch/README.md.
#
#   export TPU_NAME=rljax-pod ZONE=us-central2-b ACCELERATOR_TYPE=v4-32 RUNTIME_VERSION=tpu-ubuntu2204-base
#   launch/tpu_pod.sh create
#   launch/tpu_pod.sh install
#   launch/tpu_pod.sh train --config configs/grpo_arithmetic.py --workdir gs://BUCKET/runs/demo \
#       --config.steps=500
#   launch/tpu_pod.sh logs          # follow worker 0 (Ctrl-C stops following, not training)
#   launch/tpu_pod.sh stop          # SIGTERM on every worker: checkpoint, then exit
#   launch/tpu_pod.sh delete
#
# Settings (environment): TPU_NAME, ZONE, ACCELERATOR_TYPE, RUNTIME_VERSION, PROJECT (optional),
# SPOT=1 (spot capacity), RLJAX_PIP_SPEC (what `install` pip-installs; default: this checkout,
# packed with `git archive` and copied to every worker), DRY_RUN=1 (print the gcloud commands
# instead of running them).
set -euo pipefail

TPU_NAME="${TPU_NAME:-rljax-pod}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
PROJECT="${PROJECT:-}"
SPOT="${SPOT:-0}"
DRY_RUN="${DRY_RUN:-0}"
RLJAX_PIP_SPEC="${RLJAX_PIP_SPEC:-}"
# shellcheck disable=SC2088  # expanded by the worker's shell, not here
REMOTE_DIR='~/rljax-run'          # on every worker: config, log, pid
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo "Commands: create | install | up (create+install) | train ARGS... | logs | status |"
  echo "          run CMD... (on all workers) | stop | delete"
}

# Runs (or, with DRY_RUN=1, prints) one command, quoted so it can be pasted into a shell.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

gc_flags=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then gc_flags+=(--project="$PROJECT"); fi

# gcloud compute tpus tpu-vm ssh on all workers (or the worker in $WORKER).
on_workers() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${gc_flags[@]}" --worker="${WORKER:-all}" \
    --command="$1"
}

to_workers() {  # to_workers SRC DEST: copy a local file to every worker
  run gcloud compute tpus tpu-vm scp "$1" "$TPU_NAME:$2" "${gc_flags[@]}" --worker=all
}

cmd_create() {
  local extra=()
  if [[ "$SPOT" == 1 ]]; then extra+=(--spot); fi
  run gcloud compute tpus tpu-vm create "$TPU_NAME" "${gc_flags[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${extra[@]}"
}

cmd_install() {
  local spec="$RLJAX_PIP_SPEC"
  if [[ -z "$spec" ]]; then
    # This checkout (committed state), so every worker runs exactly the code you have.
    local tarball
    tarball="$(mktemp -d)/rljax.tar.gz"
    run git -C "$REPO_ROOT" archive --format=tar.gz --prefix=rljax/ -o "$tarball" HEAD
    to_workers "$tarball" "rljax.tar.gz"
    on_workers "rm -rf ~/rljax && tar xzf ~/rljax.tar.gz -C ~ && python3 -m pip install -q -U pip && python3 -m pip install -q \"\$HOME/rljax[tpu]\""
  else
    on_workers "python3 -m pip install -q -U pip && python3 -m pip install -q $(printf '%q' "$spec")"
  fi
  on_workers "python3 -c 'import jax, rljax; print(\"rljax\", rljax.__version__, \"jax\", jax.__version__)'"
}

cmd_train() {
  local config="" workdir="" args=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config) config="$2"; shift 2 ;;
      --config=*) config="${1#--config=}"; shift ;;
      --workdir) workdir="$2"; shift 2 ;;
      --workdir=*) workdir="${1#--workdir=}"; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  if [[ -z "$config" || -z "$workdir" ]]; then
    echo "tpu_pod.sh train: --config FILE and --workdir DIR are required" >&2; exit 2
  fi
  if [[ "$workdir" != gs://* ]]; then
    echo "tpu_pod.sh train: warning: workdir '$workdir' is not gs://; every worker must see the" \
         "same directory for collective checkpoints (use a GCS bucket)" >&2
  fi
  # The config file travels with the command (it need not be part of the installed package).
  on_workers "mkdir -p $REMOTE_DIR"
  to_workers "$config" "rljax-run/config.py"
  local remote
  remote="$(printf '%q ' python3 -m rljax.cli train --config rljax-run/config.py \
            --workdir "$workdir" "${args[@]}")"
  # RLJAX_DISTRIBUTED=1: jax.distributed.initialize() auto-detects the pod from TPU metadata.
  on_workers "cd ~ && if [ -f $REMOTE_DIR/train.pid ] && kill -0 \$(cat $REMOTE_DIR/train.pid) 2>/dev/null; then echo 'already training (tpu_pod.sh stop first)'; exit 1; fi; RLJAX_DISTRIBUTED=1 setsid nohup $remote > $REMOTE_DIR/train.log 2>&1 < /dev/null & echo \$! > $REMOTE_DIR/train.pid"
  if [[ "${FOLLOW:-1}" == 1 ]]; then cmd_logs; fi
}

cmd_logs() {
  WORKER=0 on_workers "tail -n 200 -F $REMOTE_DIR/train.log"
}

cmd_status() {
  run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${gc_flags[@]}" --format='value(state,acceleratorType,health)'
  on_workers "if [ -f $REMOTE_DIR/train.pid ] && kill -0 \$(cat $REMOTE_DIR/train.pid) 2>/dev/null; then echo \$(hostname): training; else echo \$(hostname): idle; fi"
}

cmd_stop() {
  # SIGTERM: rljax saves a checkpoint (collectively, on every worker) and exits 0.
  on_workers "if [ -f $REMOTE_DIR/train.pid ]; then kill -TERM \$(cat $REMOTE_DIR/train.pid) 2>/dev/null || true; fi"
}

cmd_delete() {
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${gc_flags[@]}" --quiet
}

main() {
  local command="${1:-help}"
  shift || true
  case "$command" in
    create) cmd_create ;;
    install) cmd_install ;;
    up) cmd_create; cmd_install ;;
    train) cmd_train "$@" ;;
    logs) cmd_logs ;;
    status) cmd_status ;;
    run) on_workers "$*" ;;
    stop) cmd_stop ;;
    delete) cmd_delete ;;
    help|-h|--help) usage ;;
    *) echo "tpu_pod.sh: unknown command '$command'" >&2; usage >&2; exit 2 ;;
  esac
}

main "$@"
