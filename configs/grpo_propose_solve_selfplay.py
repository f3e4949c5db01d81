"""Proposer/solver self-play from scratch: the tiny llama of the built-in demo writes its own
arithmetic tasks and solves them, one policy in every seat of ``propose_solve``
(rljax.envs.propose_solve): a proposer and four solvers per game. The proposer is given an
operand (0-99) and writes ``a+b=`` or ``a-b=`` starting with it (operands under 100, result
not negative; the game computes the answer); a solver sees the task and is paid 1 for the
right answer; the proposer is paid for a task that some but not all of the four solve
(``1 - solved / 4``, Absolute Zero's learnability), and forfeits (-1) any other text.

An SFT warm-up on scripted games (random valid tasks for the proposer, right answers for the
solvers) teaches both formats; then GRPO with every seat trained (``env.selfplay.mode='self'``,
``algo.adv_estimator=rae``: one baseline for proposing, one for solving). No task comes from a
dataset. Held-out evaluation seats the policy against the random proposer (uniform tasks it never
trained on) and random solvers: ``eval/win_rate_solver1`` .. ``_solver4`` are its accuracy on
random tasks, ``eval/win_rate_proposer`` how often its task is learnable for random guessers
(near 0 by design).

    rljax train --config configs/grpo_propose_solve_selfplay.py --workdir runs/propose_solve
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_arithmetic.py"))   # the demo's model and optimizer
    c.steps = 1000                     # self-play iterations (4 games x 5 seats x G=8 each)
    c.eval_every = 250
    c.checkpoint_every = 250
    c.model.overrides.max_position_embeddings = 96
    c.data = dict(source="propose_solve", template="plain", max_prompt_length=48,
                  kwargs=dict(seat="any", eval_examples=500))
    c.env = dict(name="propose_solve", max_turns=1, max_total_tokens=24, max_turn_tokens=10,
                 max_obs_tokens=8, kwargs=dict(opponent="random", illegal_penalty=-1.0),
                 selfplay=dict(mode="self"))
    c.rollout = dict(batch_size=160, max_new_tokens=10, temperature=1.0)
    c.algo.adv_estimator = "rae"
    c.reward = dict(names=())          # the game's returns only
    c.sft = dict(steps=400, learning_rate=1e-3, batch_size=64, max_length=72, env_traces=True)
    return c
