"""rljax.train.methods: training methods built on ``rljax.train.core``, used by the phases.

Each module is one method (or one workload) and may use the machinery and other methods, never
a phase or the controller (``tests/test_layout.py``). A method that changes what a rollout does
is a ``core.parts.RolloutStage`` the phase composes or a round source
(``core.parts.RoundSource``).

  agent       multi-turn episodes (env.name): the round source of GRPO / PPO rollouts and
              their credit stages, SFT on scripted episodes, held-out evaluation of episodes
              (run_agent_eval)
  matches     board games whose seats are language models: the turn loop per seat
  selfplay    env.selfplay rollouts: one policy in every seat, or a checkpoint opponent
  game_eval   win / draw / loss against fixed opponents, with Wilson intervals
  guidance    hints, ReLIFT and mixed-policy demonstrations (the Guide stage)
  relift      ReLIFT's SFT steps on the prompts the Guide buffered
  demos       mixed-policy demonstrations written into failed groups (the Guide's)
  allocation  knapsack per-prompt group sizes (rollout.allocation='knapsack'): a round
              source
  vine        VinePPO: Monte-Carlo values of step prefixes
  step_mc     step-level DPO pairs from Monte-Carlo step values
  prm_labels  Math-Shepherd step labels (fraction of correct continuations) for the PRM
  prm_rerank  a PRM at inference: step scores of sampled solutions, best-of-N
"""
