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
"""
