"""rljax.train: training, in four levels; each imports only its own level and those below
(``tests/test_layout.py``):

  core/       the machinery: train state, jitted steps, optimizers, the rollout and its
              stage protocol, checkpoints, metrics, the workdir, input checks (core/__init__.py
              lists its modules)
  methods/    training methods and workloads built on the machinery: multi-turn agents,
              self-play, hints and ReLIFT, knapsack allocation, VinePPO, step-level pairs
  phases/     the algorithms a run executes, one module each (sft, grpo, ppo, dpo, rm,
              distill, async_grpo); ALGORITHMS and PROGRAMS registries, make_phases
  inference   phase state shapes, restore, load_for_inference (a run's params for eval/sample)
  hooks       the controller's loop (run_phases) and the hooks after each iteration: metrics,
              checkpoint, eval, the non-finite guard, the no-signal hint, stop requests
  run         the controller: train (``rljax train``) and the verbs evaluate, sample, export

Submodules are imported explicitly (``from rljax.train.core import checkpoint``) so that
importing the package stays cheap and does not start a jax backend.
"""
