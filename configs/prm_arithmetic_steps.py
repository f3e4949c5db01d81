"""Process reward model on multi-step arithmetic (tiny llama, CPU, about 3 minutes).

The policy is the SFT warm-up of ``configs/grpo_arithmetic_steps.py`` (200 steps on the task's
left-to-right solutions, one line per operation: "3+4=7\\n7-2=5"). The PRM is that trunk plus a
fresh scalar head, trained on Math-Shepherd labels sampled on the fly: for two of the K
samples of each prompt (the best and the worst), every step prefix gets K continuations, and
the step's label is whether any of them reaches the verified answer (``algo.prm.soft_labels``:
the fraction that do). Labels sit on the token that ends each step.

Held out (``eval/*``): the task's eval problems, each as its reference solution and a copy with
one wrong step (later steps carry the wrong value), scored step by step: ``eval/step_auroc``
and ``eval/solution_auroc`` (the weakest step's score, ``algo.prm.step_score``).
``bench/prm_vs_orm.py`` compares it with an outcome reward model of the same size (4 min a
seed on 2 CPU cores; bench/RESULTS.md: the PRM ranks held-out steps better, the outcome model
whole solutions).

    rljax train --config configs/prm_arithmetic_steps.py --workdir runs/prm
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 400                      # PRM updates (after the warm-up)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 200
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  step_delimiter="\n",
                  kwargs=dict(digits=1, operands=3, ops="+-", steps=True, eval_examples=500))
    c.rollout = dict(batch_size=128, max_new_tokens=16, temperature=1.0)
    c.algo = dict(name="prm", num_generations=8, step_mc=dict(max_steps=4),
                  prm=dict(soft_labels=False, correct_reward=1.0, step_score="min"))
    c.optimizer = dict(learning_rate=1e-3, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=26)
    c.eval = dict(num_examples=250, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
