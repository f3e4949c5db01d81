"""Multi-turn game demo: a tiny llama from scratch plays guess-the-number (1..100) with
"higher"/"lower" hints. SFT on scripted bisection games (``sft.env_traces``), then 150 GRPO
iterations on its own games; the reward is the environment's: 1 for a solved game minus 0.05
per extra guess, so GRPO favours solving, and solving in fewer guesses.

Held-out games (secrets training never draws) are evaluated greedily after the warm-up (step
150), every 50 steps and at the end: ``eval/solved_mean`` (= ``eval/accuracy``: solved within
``env.max_turns``), ``eval/turns_mean`` (all games; an unsolved one counts 10) and
``eval/solved_turns_mean`` (solved games only). Greedy play hardly moves (bench/LOG.md, 2026-11-23, says
why); sampled play does, measured on the checkpoints after the warm-up and at the end:

    rljax train --config configs/grpo_guess_number.py --workdir runs/guess
    rljax eval --workdir runs/guess --checkpoint 150 --config.eval.temperature=1 \
        --config.eval.num_samples=8
    rljax eval --workdir runs/guess --checkpoint 300 --config.eval.temperature=1 \
        --config.eval.num_samples=8
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 150                      # GRPO iterations
    c.eval_every = 50
    c.checkpoint_every = 150
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=160))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="guess_number", template="plain", max_prompt_length=32,
                  kwargs=dict(low=1, high=100, eval_examples=200))
    # Plain transcript: "50 lower\n25 higher\n37" (the hint framed by hint_format).
    c.env = dict(name="guess_number", max_turns=10, max_total_tokens=112, max_turn_tokens=4,
                 max_obs_tokens=8, kwargs=dict(hint_format=" {hint}\n", turn_penalty=0.05))
    c.rollout = dict(batch_size=128, max_new_tokens=4, temperature=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo")
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=10, max_grad_norm=1.0)
    c.reward = dict(names=())          # the environment's reward only
    c.sft = dict(steps=150, learning_rate=1e-3, batch_size=64, max_length=144, env_traces=True)
    c.eval = dict(num_examples=200, batch_size=200)
    c.logging = dict(console_every_s=15.0)
    return c
