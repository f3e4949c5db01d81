"""What a trained Kuhn Poker policy does with each card: the probability of each legal move at
each of the 12 information sets (seat x card x moves so far), scored by teacher forcing.

    python bench/kuhn_strategy.py --workdir runs/smol_kuhn --checkpoints 10,40

Each information set is laid out as the self-play rollout lays out that seat's row (its
prompt, then for each earlier move of its own the move, the end of turn and the next state),
so chat templates and plain prompts both work. A reply is a move word then the end of turn;
``p_first`` is the first legal move's share of the two legal replies, ``legal_mass`` their
total probability. A policy that reads its card gives different ``p_first`` for J, Q and K;
Kuhn's Nash strategy (``rljax.envs.board_games.kuhn_nash_policy``) always bets with K facing a
check as P2, and always folds J facing a bet. Prints a table, and one JSON object per
checkpoint (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (seat, moves so far) where that seat is to move; each with its two legal moves.
INFOSETS = ((0, ()), (1, ("check",)), (1, ("bet",)), (0, ("check", "bet")))


def infoset_contexts(cfg, tok):
    """[(seat name, card letter, history, legal moves, context token ids)] for the 12
    information sets of ``cfg``'s Kuhn Poker self-play rows: held-out examples rendered by the
    run's data template and seat environments (``rljax.train.methods.selfplay``)."""
    from rljax import data as data_lib
    from rljax.envs.selfplay import Match, SeatEnv
    from rljax.train.core import inputs
    from rljax.train.methods import agent, selfplay

    data_cfg = inputs.data_config(cfg)
    template = data_lib.make_template(data_cfg, tok)
    renderer = agent.make_renderer(cfg, tok)
    kw = {k: v for k, v in agent.env_kwargs(cfg).items() if k in selfplay.SEAT_OPTIONS}
    task = data_lib.get_task(data_cfg)
    example = task.example(0, "eval")
    game = task.game
    out = []
    for seat, history in INFOSETS:
        for card in range(3):
            other = (card + 1) % 3   # hidden from the seat: any other card gives the same row
            match = Match(game, (card, other) if seat == 0 else (other, card))
            _, (per_seat,) = selfplay.seat_examples(cfg, [example], template)
            envs = [SeatEnv(match, sx, s, **kw) for s, sx in enumerate(per_seat)]
            firsts = [env.reset() for env in envs]
            env = envs[seat]
            ids = tok.encode(renderer.prompt(firsts[seat], model_turn=env.to_move()))
            turns = 0
            for move in history + (None,):
                mover = match.to_move()
                if mover == seat and (turns or seat):   # the first mover's state is in its prompt
                    ids += tok.encode(renderer.observation(env.observe(), True,
                                                           after_prompt=not turns))
                if move is None:
                    break
                if mover == seat:
                    ids += tok.encode(move) + [tok.eos_id]
                    turns += 1
                envs[mover].step(move)
            out.append((game.seats[seat], game.CARDS[card], history,
                        game.legal_moves(match.state), ids))
    return out


def strategy(ctx, params, contexts) -> list[dict]:
    """Each context's legal moves scored: ``p_first`` (the first move's share of the two) and
    ``legal_mass`` (their total probability as a whole reply, end of turn included)."""
    import jax.numpy as jnp
    import numpy as np

    from rljax import models

    tok, rows = ctx.tokenizer, []
    for seat, card, history, moves, ids in contexts:
        logps = []
        for move in moves:
            reply = tok.encode(move) + [tok.eos_id]
            full = jnp.asarray([ids + reply], jnp.int32)
            lp, _ = models.token_logps(ctx.model_cfg, params, full)
            logps.append(float(np.asarray(lp)[0, len(ids):].sum()))
        p = np.exp(np.array(logps))
        rows.append(dict(seat=seat, card=card, history=" ".join(history) or "-",
                         moves=list(moves), p_first=float(p[0] / p.sum()),
                         legal_mass=float(p.sum())))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoints", default="", help="comma-separated steps (default: latest)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    from rljax.train import inference
    from rljax.train.core import workdir as wd

    cfg = wd.load_workdir_config(args.workdir)
    results = []
    for step in [s for s in args.checkpoints.split(",") if s] or [None]:
        ctx, state, step = inference.load_for_inference(cfg, args.workdir, step)
        rows = strategy(ctx, state.params, infoset_contexts(cfg, ctx.tokenizer))
        print(f"\n{args.workdir} step {step}\n\n| seat | moves so far | first move | J | Q | K "
              "| legal mass (min) |\n|---|---|---|---|---|---|---|")
        for i in range(0, len(rows), 3):
            r = rows[i:i + 3]
            print(f"| {r[0]['seat']} | {r[0]['history']} | {r[0]['moves'][0]} | "
                  + " | ".join(f"{x['p_first']:.2f}" for x in r)
                  + f" | {min(x['legal_mass'] for x in r):.2f} |")
        results.append(dict(workdir=args.workdir, step=step, infosets=rows))
        print(json.dumps(results[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
