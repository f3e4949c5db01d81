"""rljax.train.core: the machinery every training method runs on.

Nothing here knows a method (``rljax.train.methods``) or a phase (``rljax.train.phases``);
``tests/test_layout.py`` holds that line. Submodules are imported explicitly
(``from rljax.train.core import checkpoint``) so importing the package starts no jax backend.

  state          TrainState, create_train_state, state shardings (principle: state is data)
  steps          jitted update steps: exact micro-batch accumulation, non-finite skip, SFT loss
  optim          optimizers and schedules from config, NonFiniteGuard
  length_groups  host-planned micro-batches of the update (group_by_length, shared_prompt)
  buckets        prompt-length buckets and the prompt ++ completion layout
  programs       Program: a phase's jitted programs with abstract inputs (what rljax plan
                 compiles); the rollout's sampler and log-prob programs
  rollout        Rollout: prompts -> G samples -> rewards -> advantages -> batch;
                 RewardRollout (PPO, DPO)
  rollout_metrics  a rollout call's metrics: rewards, advantages, lengths, sampling work,
                 staleness
  parts          the protocols of a rollout's parts that method features plug into:
                 RolloutStage, RoundSource
  partial        PartialRounds: groups carried across iterations on the slot engine (a
                 rollout's round source)
  episodes       multi-turn episodes on the host: the turn loop around the sampler
  image_inputs   a vision model's pixels and embeddings for the sampler
  teacher        a frozen second model (distillation's teacher): loading, checks, scoring
  quantized      a frozen base kept quantized on device (QLoRA, a quantized teacher)
  verifier       the first reward function, as eval and agents call it
  evaluate       held-out greedy / sampled accuracy and pass@k
  inputs         every check that needs no accelerator (check_inputs), data/reward arguments
  setup          Context (mesh, tokenizer, model, data), the Phase protocol
  checkpoint     CheckpointManager (orbax), manifests, damaged-checkpoint fallback
  metrics        metrics.jsonl, TensorBoard, wandb, the console progress line, run summary
  learning_signal  the no-signal hint (every group's rewards equal)
  workdir        config.json, resume detection, the workdir lock
  paths          local directories or URLs (gs://...)
  faults         StopSignal: graceful SIGTERM / SIGINT
  plot           ``rljax plot``
"""
