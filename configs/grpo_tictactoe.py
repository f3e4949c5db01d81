"""Board-game demo: a tiny llama from scratch plays TicTacToe, in either seat, against a
scripted opponent that moves at random. SFT on games of random *legal* moves
(``sft.env_traces`` with ``sft.trace_noise=1``: the warm-up teaches the move format and which
cells are free, not how to win), then GRPO on its own games; the reward is the environment's:
+1 win, 0 draw, -1 loss, and -1 for an illegal or unreadable move (which ends the game).

Plain transcript, one character per token: the prompt names the seat and shows the board with
free cells numbered, the model answers a cell, the observation is the board after the
opponent's reply:

    tictactoe X\\n123\\n456\\n789\\n  5  123\\n4X6\\nO89\\n  1  ...

Held-out games (seat and opponent seeds training never draws) are evaluated greedily after the
warm-up, every 50 steps and at the end: ``eval/accuracy`` = ``eval/wins_mean`` (a win pays
1), ``eval/draws_mean``, ``eval/losses_mean``, ``eval/illegal_moves_mean``, ``eval/plies_mean``
(game length), and per seat ``eval/wins_X_mean`` / ``eval/games_X_mean`` (the win rate as X is
their ratio). ``--config.env.kwargs.opponent=optimal`` plays the minimax opponent instead
(which a perfect policy can only draw).

    rljax train --config configs/grpo_tictactoe.py --workdir runs/tictactoe
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100                      # GRPO iterations
    c.eval_every = 50
    c.checkpoint_every = 100
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=128))
    c.tokenizer = dict(kind="char")
    # Prompt "tictactoe X\n" + the 12-character board: 24 tokens.
    c.data = dict(source="tictactoe", template="plain", max_prompt_length=32,
                  kwargs=dict(seat="any", eval_examples=200))
    # X moves at most 5 times (a cell + EOS each) and sees at most 4 boards: 58 tokens.
    c.env = dict(name="tictactoe", max_turns=5, max_total_tokens=64, max_turn_tokens=2,
                 max_obs_tokens=12, kwargs=dict(opponent="random", illegal_penalty=-1.0))
    c.rollout = dict(batch_size=128, max_new_tokens=2, temperature=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo")
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=10, max_grad_norm=1.0)
    c.reward = dict(names=())          # the environment's reward only
    c.sft = dict(steps=150, learning_rate=1e-3, batch_size=64, max_length=96, env_traces=True,
                 trace_noise=1.0)
    c.eval = dict(num_examples=200, batch_size=200)
    c.logging = dict(console_every_s=15.0)
    return c
