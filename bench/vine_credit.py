"""Credit assignment measured directly: how well each estimator's per-token advantages track
the Monte-Carlo advantage of the token's step (bench/LOG.md, "Credit assignment against
Monte-Carlo ground truth").

For one policy (a checkpoint of a PPO run, so its critic is there too; at the warm-up's
checkpoint, the critic PPO starts from), sample G completions
for each of P prompts and cut them into steps as VinePPO does. Ground truth: every step prefix
s_t forked ``--truth-forks`` ways, V*(s_t) the mean reward of the forks, and the step's
advantage A*_t = V*(s_{t+1}) - V*(s_t) (the completion's own reward after its last step).
Each completion token gets its step's A*_t. Against it, Pearson's correlation (over all
completion tokens) of:

- ``vineppo``: the same estimator with ``--forks`` forks (independent forks);
- ``ppo``: GAE on the PPO run's critic (its gamma, lambda; whitening does not change r);
- ``grpo``: the completion's group-normalised reward, the same for all its tokens.

    python bench/vine_credit.py --workdir W [--checkpoint STEP] --prompts 64 --forks 4 \
        --truth-forks 64 --seed 0 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rljax import algorithms  # noqa: E402
from rljax.train import inference
from rljax.train.core import setup, workdir as workdir_lib  # noqa: E402
from rljax.train.phases import make_phases  # noqa: E402
from rljax.train.phases import ppo as ppo_lib  # noqa: E402


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def vine_rollout(args):
    """A GRPO phase with the VinePPO rollout over the PPO run's data and rewards."""
    cfg = workdir_lib.load_workdir_config(args.workdir, [
        "--config.algo.name=grpo", "--config.algo.adv_estimator=vineppo",
        f"--config.algo.num_generations={args.generations}",
        f"--config.rollout.batch_size={args.prompts * args.generations}",
        f"--config.algo.vine.forks={args.forks}", f"--config.seed={args.seed}"])
    ctx = setup.build_context(cfg, tempfile.mkdtemp(prefix="vine-credit-"), jax.devices()[:1])
    return make_phases(ctx)[-1].rollout


def train_batch(rnd: dict, pad_id: int) -> dict:
    """prompt ++ completion rows (prompts left-padded) as the PPO phase scores them."""
    g = len(rnd["tokens"]) // len(rnd["prompt_ids"])
    prompts = [list(p) for p in rnd["prompt_ids"] for _ in range(g)]
    width = max(map(len, prompts))
    p_tok = np.full((len(prompts), width), pad_id, np.int32)
    p_mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        p_tok[i, width - len(p):], p_mask[i, width - len(p):] = p, True
    return {"tokens": jnp.asarray(np.concatenate([p_tok, rnd["tokens"]], 1)),
            "mask": jnp.asarray(np.concatenate([p_mask, rnd["mask"]], 1)),
            "loss_mask": jnp.asarray(rnd["mask"], jnp.float32)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="a PPO run (policy and critic)")
    ap.add_argument("--checkpoint", default=None, help="its step (default: the latest)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--forks", type=int, default=4, help="VinePPO's forks per step prefix")
    ap.add_argument("--truth-forks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    start = time.time()
    cfg_ppo = workdir_lib.load_workdir_config(args.workdir)
    if cfg_ppo.algo.name != "ppo":
        raise SystemExit(f"--workdir: a PPO run is needed for its critic, got algo.name="
                         f"{cfg_ppo.algo.name!r}")
    ctx_ppo, state, step = inference.load_for_inference(cfg_ppo, args.workdir, args.checkpoint,
                                                        jax.devices()[:1])
    if state.critic_params is None:   # the warm-up's checkpoint: PPO's starting critic
        state = inference.start_phase(ctx_ppo, make_phases(ctx_ppo)[-1], state)
    rollout = vine_rollout(args)
    rng = jax.random.PRNGKey(args.seed)
    rnd = rollout.sample_round(state.params, jax.random.fold_in(rng, 0))
    rewards = np.asarray(rnd["rewards"], np.float32)
    mask = np.asarray(rnd["mask"], bool)

    def vine_adv(values):
        return np.asarray(algorithms.vine.vineppo_advantages(
            rewards, mask=mask, step_ids=rnd["step_ids"], step_values=values,
            num_steps=rnd["num_steps"]))

    rollout.k = args.truth_forks
    truth = rollout.step_values(state.params, rnd, jax.random.fold_in(rng, 1))
    a_true = vine_adv(truth["step_values"])
    a_vine = vine_adv(rnd["step_values"])   # the round's own K forks, independent of truth's

    batch = train_batch(rnd, ctx_ppo.tokenizer.pad_id)
    values = ppo_lib.completion_values(ctx_ppo.model_cfg, state.critic_params, batch)
    a_ppo, _, _ = ppo_lib.advantages_and_returns(cfg_ppo.algo, jnp.asarray(rewards), values,
                                                 None, None, jnp.asarray(mask))
    a_grpo = np.asarray(algorithms.get_advantage_estimator("grpo")(
        jnp.asarray(rewards), args.generations))[:, None] * np.ones_like(mask, np.float32)

    m = mask & (np.asarray(rnd["step_ids"]) >= 0)
    out = {"workdir": args.workdir, "checkpoint": int(step), "seed": args.seed,
           "prompts": args.prompts, "generations": args.generations, "forks": args.forks,
           "truth_forks": args.truth_forks, "tokens": int(m.sum()),
           "steps_mean": float(np.mean(rnd["num_steps"])), "reward_mean": float(rewards.mean()),
           "truth_abs_mean": float(np.abs(a_true[m]).mean()),
           "corr": {name: pearson(np.asarray(a)[m], a_true[m])
                    for name, a in (("vineppo", a_vine), ("ppo", a_ppo), ("grpo", a_grpo))},
           "seconds": round(time.time() - start, 1)}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
