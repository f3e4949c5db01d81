"""rljax.train: the machinery of training (train state, jitted steps, rollouts, checkpoints,
metrics, optimizers, fault handling), the algorithms built on it as phases (``phases/``), and
the controller that runs them (``run.py``).

Imports flow one way: machinery <- ``phases`` <- ``inference`` <- ``run`` <- ``rljax.cli``.

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
  steps       exact micro-batch accumulation, non-finite skip; build_sft_step,
              build_logps_fn (jitted, explicit shardings, state donated)
  length_groups  host-planned micro-batches of the GRPO update (every config) and of the
              old/ref log-prob passes: algo.group_by_length (rows of similar length, trimmed
              to their real columns), algo.shared_prompt (whole groups, each prompt computed
              once: rljax.models.shared_prompt)
  programs    Program: a phase's jitted program with abstract inputs (what rljax plan
              compiles); the rollout's sampler and log-prob programs
  buckets     prompt_buckets (prompt-length buckets of the rollout and length_groups)
  rollout     Rollout: prompts -> G samples -> rewards -> advantages -> training batch (DAPO
              dynamic sampling, overlong shaping, KL-in-reward)
  rollout     also RewardRollout (raw rewards instead of advantages, for PPO and online DPO)
  agent       MultiTurnRollout / MultiTurnRewardRollout: episodes (env.name) for GRPO / PPO,
              SFT on scripted episodes, agentic eval
  matches     run_matches: board games whose seats are models, one episode per seat, a
              cache per side (self-play, a frozen opponent)
  selfplay    env.selfplay rollouts (one policy in every seat, a checkpoint opponent)
  game_eval   evaluate_games: win/draw/loss against fixed opponents with Wilson intervals
  evaluate    run_eval (greedy accuracy, pass@k), eval_examples
  setup       check_inputs (before compiling), Context (mesh, tokenizer, model), Phase protocol

  phases/     the algorithms, one module each (sft, grpo, ppo, dpo, rm); ALGORITHMS and
              PROGRAMS registries, register_algorithm, make_phases, phase_programs
  inference   phase state shapes, restore, load_for_inference (a run's params for eval/sample)
  run         the controller: train (``rljax train``) and the verbs evaluate, sample, export
"""
