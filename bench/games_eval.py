"""Win, draw and loss rates of a trained board-game policy against fixed opponents, with 95%
Wilson intervals (``rljax.train.methods.game_eval``).

    python bench/games_eval.py --workdir runs/tictactoe --games 200 \\
        --opponents random,optimal,checkpoint:runs/tictactoe@150

Opponents: ``random`` (uniform legal moves), ``optimal`` (TicTacToe minimax, Kuhn Poker Nash),
``fair`` (Negotiation's fixed negotiator),
``checkpoint:WORKDIR[@STEP]`` (a frozen run, greedy unless ``--opponent-temperature``). The
policy plays the held-out games of its run (``eval`` split, the first ``--games``; the seat
of each as the task drew it, or ``--seat``), greedily unless ``--temperature``. Prints a
markdown table and one JSON object per opponent (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint", default=None, help="step of the policy (default: latest)")
    p.add_argument("--opponents", default="random,optimal")
    p.add_argument("--games", type=int, default=200)
    p.add_argument("--seat", default="", help="a seat name for every game (default: the task's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--opponent-temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def _opponents(ctx, spec: str, temperature: float):
    from rljax.errors import UserError
    from rljax.train.methods import game_eval, selfplay
    for name in [s for s in spec.split(",") if s]:
        if name in game_eval.SCRIPTED:
            yield name, name
        elif name.startswith("checkpoint:"):
            path, _, step = name[len("checkpoint:"):].partition("@")
            yield name, selfplay.opponent_from_workdir(ctx, path, int(step or 0), temperature,
                                                       key="--opponents")
        else:
            raise UserError(f"--opponents: {name!r} is not {', '.join(game_eval.SCRIPTED)} or "
                            "checkpoint:WORKDIR[@STEP]")


def main(argv=None) -> int:
    args = _parse(argv)
    import jax

    from rljax.train import inference
    from rljax.train.core import evaluate, workdir as wd
    from rljax.train.methods import game_eval

    overrides = [f"--config.eval.num_examples={args.games}", f"--config.eval.batch_size={args.games}"]
    if args.seat:
        overrides.append(f"--config.data.kwargs.seat={args.seat}")
    cfg = wd.load_workdir_config(args.workdir, overrides)
    ctx, state, step = inference.load_for_inference(cfg, args.workdir, args.checkpoint)
    examples = evaluate.eval_examples(ctx)
    rows = []
    print("| opponent | games | win [95% CI] | draw [95% CI] | loss [95% CI] | illegal | "
          "win rate per seat |\n|---|---|---|---|---|---|---|")
    for name, opponent in _opponents(ctx, args.opponents, args.opponent_temperature):
        m = game_eval.evaluate_games(ctx, state.params, examples, opponent,
                                     jax.random.key(args.seed), temperature=args.temperature)
        row = {"workdir": args.workdir, "step": step, "opponent": name, **m}
        rows.append(row)
        ci = lambda k: f"{m[f'games/{k}']:.3f} [{m[f'games/{k}_ci95'][0]:.3f}, {m[f'games/{k}_ci95'][1]:.3f}]"  # noqa
        seats = ", ".join(f"{k.rsplit('_', 1)[1]} {v:.3f}" for k, v in m.items()
                          if k.startswith("games/win_rate_") and not k.endswith("_ci95"))
        print(f"| {name} | {m['games/games']} | {ci('wins')} | {ci('draws')} | {ci('losses')} "
              f"| {m['games/illegal_moves']:.3f} | {seats} |", flush=True)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
