"""rljax.train: train state, checkpoints, metrics, optimizers, fault handling (and, built on
them, the jitted steps in ``steps.py`` and the controller loop in ``run.py``).

Submodules are imported explicitly (``from rljax.train import checkpoint``) so that importing
the package stays cheap and does not start a jax backend:

  state       TrainState, create_train_state, eval_state_shape, state_shardings,
              abstract_train_state
  checkpoint  CheckpointManager (orbax), Restored, checkpoint_dir, has_checkpoint
  metrics     MetricsWriter, read_metrics
  optim       make_optimizer, make_schedule, apply_if_finite, NonFiniteGuard
  faults      StopSignal (graceful SIGTERM/SIGINT)
  workdir     config.json handling and resume detection
  plot        plot_metrics (``rljax plot``)
  steps       exact micro-batch accumulation, non-finite skip; build_sft_step, build_grpo_step,
              build_logps_fn (jitted, explicit shardings, state donated)
  rollout     Rollout: prompts -> G samples -> rewards -> advantages -> training batch (DAPO
              dynamic sampling, overlong shaping, KL-in-reward)
  evaluate    run_eval (greedy accuracy, pass@k), evaluate (``rljax eval``)
  setup       check_inputs (before compiling), Context (mesh, tokenizer, model), Phase protocol
  sft, grpo   SFTPhase, GRPOPhase: one iteration each of SFT / the GRPO family
  run         train (``rljax train``), sample, export; ALGORITHMS registry of phases
"""
