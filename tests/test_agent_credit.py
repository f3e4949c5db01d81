"""Credit assignment over multi-turn episodes: per-turn discounted returns and their GRPO-family
advantages (``algorithms.turn_credit``, ``env.turn_discount``), GAE over model tokens with
observation gaps and a turn discount, and PPO over episodes (observations carry no gradient
for the policy or the value loss; a run checkpoints and resumes exactly)."""
import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import algorithms
from rljax import config as config_lib
from rljax.algorithms import turn_credit
from rljax.envs import StepResult, register_env
from rljax.train import run
from rljax.train.core import checkpoint, setup
from rljax.train.core.metrics import read_metrics
from rljax.train.core.rollout import RewardRollout
from rljax.train.methods.agent import EpisodeRounds
from rljax.train.phases import ppo
from rljax.train.core.state import create_train_state
from tests.test_agent_train import (DEVICES, agent_cfg, assert_one_line_config_error,
                                    episode_rollout, watch_rows)
from tests.test_train_loop import StopAfter, comparable


# ----------------------------------------------------------------------------- pure functions

def test_turn_returns_match_the_written_out_sum():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(5, 4)).astype(np.float32)
    turns = np.array([4, 1, 2, 3, 4])
    gamma = 0.7
    got = turn_credit.turn_returns(rewards, turns, gamma)
    for i in range(5):
        for t in range(4):
            want = sum(gamma ** k * rewards[i, t + k] for k in range(turns[i] - t)) \
                if t < turns[i] else 0.0
            np.testing.assert_allclose(got[i, t], want, rtol=1e-5, atol=1e-6)
    # by hand: r = (1, 2, 3), gamma 0.5 -> R = (1 + 1 + 0.75, 2 + 1.5, 3)
    np.testing.assert_allclose(turn_credit.turn_returns(
        np.array([[1.0, 2.0, 3.0, 9.0]], np.float32), np.array([3]), 0.5),
        [[2.75, 3.5, 3.0, 0.0]])


def _played(turns, t):
    return np.arange(t)[None, :] < turns[:, None]


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("grpo", "batch"),
                                             ("grpo", "none"), ("dr_grpo", "group"),
                                             ("rloo", "group")])
def test_turn_advantages_match_the_written_out_rule(estimator, scale, ragged):
    """A_{i,t} = (R_{i,t} - baseline from the group's R_{j,0}) / scale; constant groups 0.
    ``ragged``: groups of their own sizes, rows in any order (``group_ids``, knapsack
    allocation)."""
    rng = np.random.default_rng(1)
    g, groups, t = 4, 3, 3
    returns = rng.normal(size=(g * groups, t)).astype(np.float32)
    turns = rng.integers(1, t + 1, size=g * groups)
    ids = np.repeat(np.arange(groups), [5, 4, 3] if ragged else g)
    if ragged:
        ids = rng.permutation(ids)
    returns[ids == 1, 0] = 0.5                     # group 1: equal episode returns
    returns = np.where(_played(turns, t), returns, 0.0).astype(np.float32)
    got = turn_credit.turn_advantages(returns, turns, g, estimator=estimator,
                                      scale_rewards=scale, group_ids=ids if ragged else None)
    first = returns[:, 0].astype(np.float64)
    batch_std = first.std(ddof=1)
    for i in range(g * groups):
        grp = first[ids == ids[i]]
        for k in range(t):
            if k >= turns[i] or grp.max() == grp.min():
                assert got[i, k] == 0.0
                continue
            if estimator == "rloo":
                want = returns[i, k] - (grp.sum() - first[i]) / (grp.size - 1)
            else:
                want = returns[i, k] - grp.mean()
            if estimator == "grpo" and scale == "group":
                want /= grp.std(ddof=1) + 1e-6
            elif estimator == "grpo" and scale == "batch":
                want /= batch_std + 1e-6
            np.testing.assert_allclose(got[i, k], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("estimator", turn_credit.TURN_ESTIMATORS)
def test_gamma_one_and_a_final_reward_is_outcome_grpo_exactly(estimator):
    rng = np.random.default_rng(2)
    g, n, t = 4, 16, 3
    turns = rng.integers(1, t + 1, size=n)
    final = rng.integers(0, 3, size=n).astype(np.float32) * 0.5
    per_turn = np.zeros((n, t), np.float32)
    per_turn[np.arange(n), turns - 1] = final
    returns = turn_credit.turn_returns(per_turn, turns, 1.0)
    got = turn_credit.turn_advantages(returns, turns, g, estimator=estimator)
    outcome = np.asarray(algorithms.get_advantage_estimator(estimator)(final, g))
    played = _played(turns, t)
    np.testing.assert_array_equal(got[played], np.broadcast_to(outcome[:, None], (n, t))[played])
    assert (got[~played] == 0).all()


# One hand-built row: model turns 0 (3 tokens), 1 (2 tokens), 2 (1 token) with observations
# (-1) between them and padding after; a second row ends on turn 0's last slot.
TURN_IDS = np.array([[0, 0, 0, -1, -1, 1, 1, -1, 2, -1],
                     [0] * 10], np.int32)
TURN_REWARDS = np.array([[0.5, -0.25, 1.0], [2.0, 0.0, 0.0]], np.float32)


def test_turn_end_rewards_and_discounts_by_hand():
    r = turn_credit.turn_end_rewards(TURN_REWARDS, TURN_IDS)
    np.testing.assert_array_equal(r[0], [0, 0, 0.5, 0, 0, 0, -0.25, 0, 1.0, 0])
    np.testing.assert_array_equal(r[1], [0] * 9 + [2.0])
    d = turn_credit.turn_end_discounts(TURN_IDS, 0.8)
    np.testing.assert_array_equal(d[0], np.float32([1, 1, .8, 1, 1, 1, .8, 1, .8, 1]))
    np.testing.assert_array_equal(d[1], np.float32([1] * 9 + [.8]))
    adv = turn_credit.spread_over_turns(np.array([[1., 2., 3.], [4., 5., 6.]]), TURN_IDS)
    np.testing.assert_array_equal(adv[0], [1, 1, 1, 0, 0, 2, 2, 0, 3, 0])


def _gae_reference(rewards, values, turn_ids, gamma, lam, turn_discount):
    """GAE written out over the compact list of model tokens of one row."""
    idx = [p for p in range(len(turn_ids)) if turn_ids[p] >= 0]
    adv = np.zeros(len(turn_ids))
    next_v = next_a = 0.0
    for k in reversed(range(len(idx))):
        p = idx[k]
        end_of_turn = k + 1 == len(idx) or turn_ids[idx[k + 1]] != turn_ids[p]
        d = gamma * (turn_discount if end_of_turn else 1.0)
        delta = rewards[p] + d * next_v - values[p]
        adv[p] = delta + d * lam * next_a
        next_v, next_a = values[p], adv[p]
    return adv


def test_gae_over_model_tokens_skips_observations_and_discounts_turns():
    rng = np.random.default_rng(3)
    values = rng.normal(size=TURN_IDS.shape).astype(np.float32)
    mask = TURN_IDS >= 0
    rewards = turn_credit.turn_end_rewards(TURN_REWARDS, TURN_IDS)
    # Observation slots hold garbage rewards and values: the recursion must not read them.
    noisy_r = np.where(mask, rewards, 100.0).astype(np.float32)
    noisy_v = np.where(mask, values, -50.0).astype(np.float32)
    gamma, lam, turn_gamma = 0.95, 0.9, 0.8
    adv, ret = algorithms.gae(noisy_r, noisy_v, mask, gamma=gamma, lam=lam,
                              next_discount=turn_credit.turn_end_discounts(TURN_IDS, turn_gamma))
    for row in range(2):
        want = _gae_reference(rewards[row], values[row], TURN_IDS[row], gamma, lam, turn_gamma)
        np.testing.assert_allclose(adv[row], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, np.where(mask, np.asarray(adv) + values, 0), atol=1e-6)
    # No next_discount: the plain token-level GAE (gamma everywhere).
    plain, _ = algorithms.gae(rewards, values, mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(plain[0], _gae_reference(rewards[0], values[0], TURN_IDS[0],
                                                        gamma, lam, 1.0), rtol=1e-5, atol=1e-6)


def test_turn_estimators_match_config_list():
    assert config_lib.TURN_ESTIMATORS == turn_credit.TURN_ESTIMATORS


# ----------------------------------------------------------------------------- on episodes

class TurnRewardEnv:
    """Two turns whatever the model writes: turn 0 pays (len % 3) / 3 and answers with an
    observation, turn 1 pays (len % 4) / 4 and ends. ``final_only``: turn 0 pays nothing."""

    def __init__(self, example, final_only=False):
        self.example, self.turns, self.final_only = example, 0, final_only

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns >= 2:
            return StepResult(reward=(len(text) % 4) / 4, done=True)
        reward = 0.0 if self.final_only else (len(text) % 3) / 3
        return StepResult(observation=[{"role": "tool", "content": f"<r>{len(text)}</r>"}],
                          reward=reward)


register_env("test_turn_rewards", TurnRewardEnv)


def episode_cfg(**overrides):
    base = {"sft.steps": 0, "sft.env_traces": False, "env.name": "test_turn_rewards",
            "env.tools": (), "rollout.max_new_tokens": 8, "reward.names": ()}
    cfg = agent_cfg(**{**base, **overrides})
    cfg.env.kwargs = {}
    return cfg


def _context(cfg, tmp_path):
    setup.check_inputs(cfg, num_devices=1)
    return setup.build_context(cfg, str(tmp_path), devices=DEVICES)


@pytest.mark.parametrize("kl", [False, True])
def test_rollout_gamma_one_final_reward_equals_outcome_advantages(tmp_path, kl):
    """The same episodes (same seed) with env.turn_discount=1.0 and None: every model token's
    advantage is the outcome GRPO advantage, bit for bit. ``kl`` (``algo.kl_in_reward``):
    each turn pays beta x its own tokens' KL to a reference that differs from the policy, so
    the first turn's return is the outcome less beta x the episode's KL, as the outcome
    rollout folds it (equal up to the order of the sums)."""
    extra = {"algo.kl_in_reward": True, "algo.beta": 0.5} if kl else {}
    outcome_cfg = episode_cfg(**extra)
    outcome_cfg.env.kwargs = {"final_only": True}
    turn_cfg = episode_cfg(**{"env.turn_discount": 1.0, **extra})
    turn_cfg.env.kwargs = {"final_only": True}
    ctx = _context(outcome_cfg, tmp_path)
    ref = jax.tree.map(lambda x: x * 1.5, ctx.params) if kl else None
    state = create_train_state(ctx.params, optax.sgd(0.1), jax.random.key(0), ref_params=ref)
    outcome = episode_rollout(ctx, setup.data_iterator(ctx, 2))
    per_turn = episode_rollout(ctx, setup.data_iterator(ctx, 2), cfg=turn_cfg)
    seen = watch_rows(per_turn)
    a, _ = outcome(state, 0)
    b, _ = per_turn(state, 0)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert a["advantages"].ndim == 1 and b["advantages"].shape == b["loss_mask"].shape
    assert np.abs(a["advantages"]).max() > 0, "rewards should differ within a group"
    m = b["loss_mask"]
    assert (b["advantages"][~m] == 0).all()
    if kl:   # the first turn's return only: a later turn does not pay an earlier one's KL
        m = m & (seen.rows["turn_ids"] == 0)
    check = (functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5) if kl
             else np.testing.assert_array_equal)
    check(b["advantages"][m], np.broadcast_to(a["advantages"][:, None], m.shape)[m])
    if kl:   # the KL moved the advantages: not those of the task reward alone
        plain = episode_rollout(ctx, setup.data_iterator(ctx, 2), cfg=episode_cfg(
            **{"env.turn_discount": 1.0}))
        plain.cfg.env.kwargs = {"final_only": True}
        c, _ = plain(state.replace(ref_params=None), 0)
        assert np.abs(c["advantages"][m] - b["advantages"][m]).max() > 1e-3


def test_rollout_per_turn_rewards_reach_their_turns(tmp_path):
    """Each turn's environment reward stays on its turn: the advantages are the turn rule's
    on (turn 0 + gamma * turn 1, turn 1) returns, constant within each turn."""
    gamma = 0.5
    cfg = episode_cfg(**{"env.turn_discount": gamma})
    ctx = _context(cfg, tmp_path)
    state = create_train_state(ctx.params, optax.sgd(0.1), jax.random.key(0))
    rollout = episode_rollout(ctx, setup.data_iterator(ctx, 2))
    seen = watch_rows(rollout)
    batch, _ = rollout(state, 0)
    rows = seen.rows
    texts = [ctx.tokenizer.decode(batch["tokens"][i, -batch["loss_mask"].shape[1]:][
        rows["turn_ids"][i] == t].tolist()) for i in range(8) for t in (0, 1)]
    want_r = np.array([[(len(texts[2 * i]) % 3) / 3, (len(texts[2 * i + 1]) % 4) / 4]
                       for i in range(8)], np.float32)
    assert (rows["turns"] == 2).all()
    np.testing.assert_allclose(rows["turn_rewards"][:, :2], want_r, atol=1e-6)
    returns = np.stack([want_r[:, 0] + gamma * want_r[:, 1], want_r[:, 1]], 1)
    want = turn_credit.turn_advantages(returns, rows["turns"], 4)
    for t in (0, 1):
        on_turn = rows["turn_ids"] == t
        np.testing.assert_allclose(batch["advantages"][on_turn],
                                   np.broadcast_to(want[:, t:t + 1], on_turn.shape)[on_turn],
                                   rtol=1e-5, atol=1e-6)


def test_ppo_loss_ignores_observation_tokens(tmp_path):
    """PPO over a real episode batch: changing every per-token input of the loss (old, sampler
    and reference log-probs, advantages, returns, old values) at observation positions changes
    neither the loss nor the gradient of the policy or the critic; at one model token it does.
    The prepared advantages and returns are 0 at observations (GAE skips them)."""
    cfg = episode_cfg(**{"algo.name": "ppo", "algo.adv_estimator": "gae", "algo.beta": 0.04,
                         "algo.kl_in_reward": False, "algo.tis_cap": 2.0,
                         "algo.cliprange_value": 0.2, "env.turn_discount": 0.9})
    ctx = _context(cfg, tmp_path)
    phase = ppo.PPOPhase(ctx, 2)
    # PPO's plain reward rollout: the episodes are its round source, the turn-end rewards a stage
    assert type(phase.rollout) is RewardRollout
    assert isinstance(phase.rollout.rounds, EpisodeRounds)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    seen = watch_rows(phase.rollout)
    batch, _ = phase.rollout(state, 0)
    assert "token_rewards" in batch and "next_discount" in batch
    rows = seen.rows   # each turn's reward on its last model token, the turn discount there
    np.testing.assert_array_equal(batch["token_rewards"], turn_credit.turn_end_rewards(
        rows["turn_rewards"], rows["turn_ids"]))
    np.testing.assert_array_equal(batch["next_discount"],
                                  turn_credit.turn_end_discounts(rows["turn_ids"], 0.9))
    np.testing.assert_array_equal(batch["rewards"], rows["rewards"])
    prepared, _ = phase.prepare(state, {k: jnp.asarray(v) for k, v in batch.items()})
    prepared = {k: np.asarray(v) for k, v in prepared.items()}
    n = batch["loss_mask"].shape[1]
    obs = batch["mask"][:, -n:] & ~batch["model_mask"]
    assert obs.sum() > 0, "the batch should have observation tokens"
    np.testing.assert_array_equal(batch["loss_mask"], batch["model_mask"])
    assert (prepared["advantages"][obs] == 0).all() and (prepared["returns"][obs] == 0).all()

    joint = {"policy": state.params, "critic": state.critic_params}

    @jax.jit
    def value_and_grad(params, b):
        def loss(p):
            (num, den), _ = ppo.ppo_loss(ctx.model_cfg, cfg.algo, 1.0, p, state, b)
            return num / den
        return jax.value_and_grad(loss)(params)

    def loss_and_grad(b):
        value, grad = value_and_grad(joint, {k: jnp.asarray(v) for k, v in b.items()})
        return float(value), grad

    keys = ("old_logps", "sampler_logps", "ref_logps", "advantages", "returns", "old_values")

    def perturbed(where):
        b = dict(prepared)
        rs = np.random.default_rng(0)
        for key in keys:
            x = np.array(b[key])
            x[where] = rs.normal(size=int(where.sum())) * 3
            b[key] = x
        return b

    base_loss, base_grad = loss_and_grad(prepared)
    loss, grad = loss_and_grad(perturbed(obs))
    assert loss == base_loss
    jax.tree.map(np.testing.assert_array_equal, grad, base_grad)
    first = tuple(np.argwhere(batch["model_mask"])[0])
    one = np.zeros_like(obs)
    one[first] = True
    moved_loss, moved_grad = loss_and_grad(perturbed(one))
    assert moved_loss != base_loss
    # The value loss alone sees the model token too: only returns/old_values perturbed.
    b = dict(prepared)
    for key in ("returns", "old_values"):
        b[key] = np.array(b[key])
        b[key][first] += 5.0
    critic_grad = loss_and_grad(b)[1]["critic"]
    assert any(not np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(critic_grad), jax.tree.leaves(base_grad["critic"])))


PPO_EPISODES = {"algo.name": "ppo", "algo.adv_estimator": "gae", "algo.num_generations": 2,
                "algo.mini_batch_size": 4, "algo.num_iterations": 2, "env.turn_discount": 0.9,
                "steps": 2, "sft.steps": 0, "sft.env_traces": False}


def _critic(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        state = ckpt.restore().state
    return jax.tree.map(np.asarray, (state["params"], state["critic_params"]))


@pytest.mark.slow
def test_ppo_over_episodes_stops_and_resumes_exactly(tmp_path):
    """PPO on the tool environment: straight vs stopped after the first PPO iteration and
    resumed: same metrics, policy and critic."""
    cfg = agent_cfg(**PPO_EPISODES)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight, devices=DEVICES) == 0
    records = read_metrics(straight)
    rl = [r for r in records if "vf_loss" in r]
    assert len(rl) == 2 and all(np.isfinite(r["vf_loss"]) for r in rl)
    assert "env/turns_mean" in rl[0] and any("eval/accuracy" in r for r in records)
    assert run.train(cfg, resumed, devices=DEVICES,
                     stop=StopAfter(cfg.sft.steps + 1)) == 0
    assert max(r["step"] for r in read_metrics(resumed)) == cfg.sft.steps + 1
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal, _critic(resumed), _critic(straight))


@pytest.mark.parametrize("override,needle", [
    ("--config.env.turn_discount=1.5", "env.turn_discount=1.5 must be in [0, 1]"),
    ("--config.algo.adv_estimator=reinforce_pp", "env.turn_discount (per-turn returns) needs "
                                                 "algo.adv_estimator"),
    ("--config.env.name=", "env.turn_discount needs multi-turn episodes (env.name)"),
])
def test_bad_turn_discount_is_one_line_exit_2(tmp_path, override, needle):
    body = "c = agent_cfg(**{'sft.env_traces': False}); c.env.turn_discount = 0.9; return c"
    assert_one_line_config_error(tmp_path, body, override, needle)
