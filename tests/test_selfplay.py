"""Self-play in board games: role-conditioned advantages (RAE) in the trainer, one policy in
every seat, a frozen checkpoint as the opponent, win rates with confidence intervals."""
import re

import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.envs.game_env import NUM_ROLES
from rljax.train import run
from rljax.train.core import checkpoint, setup
from rljax.train.core.metrics import read_metrics
from rljax.train.phases import grpo
from rljax.train.core.state import create_train_state
from tests.test_agent_train import episode_rollout, watch_rows
from tests.test_train_loop import StopAfter, comparable, final_params, resumes_exactly

DEVICES = jax.devices()[:1]


def ttt_cfg(**overrides):
    """configs/grpo_tictactoe.py with a 1-layer width-32 model and small batches."""
    cfg = config_lib.load_config("configs/grpo_tictactoe.py", [
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "algo.num_generations=2",
        "eval.num_examples=4", "eval.batch_size=4", "eval_every=0", "checkpoint_every=0",
        "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1",
        "model.overrides.num_layers=1", "model.overrides.hidden_size=32",
        "model.overrides.intermediate_size=64"])
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


def _phase(cfg, tmp_path):
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    phase = grpo.GRPOPhase(ctx, int(cfg.steps))
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    return ctx, phase, state


# ----------------------------------------------------------------------------- RAE


@pytest.mark.parametrize("dynamic", [False, True])
def test_rae_in_the_rollout_is_the_written_out_formula(tmp_path, monkeypatch, dynamic):
    """The trainer's RAE advantages and new baselines on one batch of episodes equal
    b_k <- alpha b_k + (1 - alpha) mean(R | role k), A = R - b_role, written out in numpy,
    over the episodes that train: with dynamic sampling a group that only pads the batch
    neither moves the baselines nor gets an advantage."""
    alpha = 0.8
    cfg = ttt_cfg(**{"algo.adv_estimator": "rae", "algo.rae_alpha": alpha,
                     "algo.dynamic_sampling": dynamic, "algo.max_sampling_rounds": 1})
    ctx, phase, state = _phase(cfg, tmp_path)
    assert state.role_baseline.shape == (NUM_ROLES,) and not state.role_baseline.any()
    start = np.array([0.25, -0.5, 0.125, 1.0, 0.5, -0.25], np.float32)
    state = state.replace(role_baseline=jax.numpy.asarray(start))
    sample_round = phase.rollout.sample_round

    def one_won_group(*args, **kw):   # each round: the first group's first episode wins
        rnd = sample_round(*args, **kw)
        rnd["rewards"] = np.where(np.arange(len(rnd["rewards"])) == 0, 1.0, rnd["rewards"])
        return rnd

    monkeypatch.setattr(phase.rollout, "sample_round", one_won_group)
    seen = watch_rows(phase.rollout)
    batch, metrics = phase.rollout(state, 0)
    rows = seen.rows
    roles, rewards = rows["roles"], rows["rewards"]
    assert set(roles.tolist()) <= {0, 1}   # tictactoe X = 0, O = 1
    trains = batch["loss_mask"].any(-1)
    assert trains.all() != dynamic and metrics["rollout/filler_groups"] == 2 * dynamic
    expected = start.copy()
    for k in range(6):
        if (trains & (roles == k)).any():
            expected[k] = (alpha * start[k]
                           + (1 - alpha) * rewards[trains & (roles == k)].mean())
    np.testing.assert_allclose(batch["role_baseline"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(batch["advantages"],
                               np.where(trains, rewards - expected[roles], 0.0), rtol=1e-6,
                               atol=1e-6)
    for k in set(roles.tolist()):
        assert metrics[f"rae/baseline_{k}"] == pytest.approx(float(expected[k]))


def _baseline(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        state = ckpt.restore().state
    return np.asarray(state["role_baseline"]), jax.tree.map(np.asarray, state["params"])


RAE_RUN = {"algo.adv_estimator": "rae", "algo.num_generations": 1}


@pytest.fixture(scope="module")
def rae_run(tmp_path_factory):
    """A 2-iteration RAE run (its checkpoint is also the frozen opponent below)."""
    workdir = str(tmp_path_factory.mktemp("rae_straight"))
    assert run.train(ttt_cfg(**RAE_RUN), workdir, devices=DEVICES) == 0
    return workdir


@pytest.mark.slow
def test_rae_run_checkpoints_its_baselines_and_resumes_exactly(rae_run, tmp_path):
    """A RAE run stopped after its first iteration and resumed equals the straight run:
    metrics (the baselines' included), parameters and the checkpointed baselines."""
    cfg = ttt_cfg(**RAE_RUN)
    records = read_metrics(rae_run)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == 2 and any(k.startswith("rae/baseline_") for k in rl[1])
    resumed = str(tmp_path / "resumed")
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert max(r["step"] for r in read_metrics(resumed)) == 1
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(records)
    (b1, p1), (b2, p2) = _baseline(rae_run), _baseline(resumed)
    assert b1.shape == (NUM_ROLES,) and np.abs(b1).max() > 0
    np.testing.assert_array_equal(b1, b2)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_rae_with_games_sampled_ahead_resumes_exactly(tmp_path):
    """algo.asynchronous with RAE: the sampler's baselines move with each batch as it is
    drawn (a version ahead of the update), as the train state's do in the synchronous run,
    and a run stopped after update 2 and resumed (the next batch's baselines read from the
    last batch in flight) equals the straight run."""
    cfg = lambda: ttt_cfg(**{**RAE_RUN, "algo.asynchronous": True, "steps": 4})  # noqa: E731
    straight, split = resumes_exactly(cfg, tmp_path, stop_after=2, devices=DEVICES)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1, 2]
    keys = sorted(k for k in rl[0] if k.startswith("rae/baseline_"))
    assert keys and len({tuple(r[k] for k in keys) for r in rl}) > 1   # the baselines move
    np.testing.assert_array_equal(_baseline(straight)[0], _baseline(split)[0])


@pytest.mark.parametrize("overrides,needle", [
    ({"env.name": ""}, "needs each episode's role"),
    ({"env.turn_discount": 0.9}, "env.turn_discount"),
    ({"algo.rae_alpha": 1.5}, "algo.rae_alpha"),
])
def test_rae_config_errors_are_one_line(overrides, needle):
    with pytest.raises(config_lib.ConfigError, match=needle) as e:
        ttt_cfg(**{"algo.adv_estimator": "rae", **overrides})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- self-play


@pytest.fixture
def lowest_cell(monkeypatch):
    """Every seat's turn, whatever its text, plays the lowest free cell: whole games from an
    untrained model (X takes 1, 3, 5, 7 and wins on the 3-5-7 diagonal at ply 7)."""
    from rljax.envs.selfplay import SeatEnv
    step = SeatEnv.step
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(
        self, self.game.legal_moves(self.match.state)[0]))


@pytest.fixture
def text_parity_cell(monkeypatch):
    """A move is the lowest free cell when the turn's text starts with an even character,
    else the highest: whole games whose outcomes turn on the sampled text."""
    from rljax.envs.selfplay import SeatEnv
    step = SeatEnv.step
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(self, self.game.legal_moves(
        self.match.state)[0 if ord((text or "\0")[0]) % 2 == 0 else -1]))


def test_selfplay_rows_are_seats_with_their_own_tokens_and_rewards(tmp_path, lowest_cell):
    """One policy in both seats: each row is one seat of one match, its model tokens are its
    own moves, its observations the board after the other seat's, its reward its seat's
    return; the sampler's log-probs (a cache per seat, skipping the other seat's plies) are
    the trainer's. MoPPS picks the games and learns from each seat's group of a game for that
    game (X's wins, then O's)."""
    from rljax.data import selection
    g = 2
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.adv_estimator": "rae",
                     "algo.num_generations": g, "data.selection.name": "predicted"})
    ctx, phase, state = _phase(cfg, tmp_path)
    rollout = episode_rollout(ctx, setup.rl_iterator(ctx, 2))   # 2 games x 2 seats x G
    rnd = rollout.sample_round(state.params, jax.random.key(3))
    eps, tok = rnd["episodes"], ctx.tokenizer
    n = len(eps["env_rewards"])
    seat = np.repeat(np.tile([0, 1], 2), g)                      # groups (example, seat)
    np.testing.assert_array_equal(eps["roles"], seat)
    np.testing.assert_array_equal(eps["env_rewards"], np.where(seat == 0, 1.0, -1.0))
    np.testing.assert_array_equal(eps["turns"], np.where(seat == 0, 4, 3))
    assert not eps["truncated"].any()
    for i in range(n):
        text = eps["transcripts"][i]
        assert eps["prompts"][i] == ("tictactoe X\n123\n456\n789\n" if seat[i] == 0
                                     else "tictactoe O\n")
        obs = tok.decode(eps["tokens"][i][eps["mask"][i] & ~eps["model_mask"][i]].tolist())
        if seat[i] == 0:   # X sees the boards after O's replies
            assert obs == "XO3\n456\n789\nXOX\nO56\n789\nXOX\nOXO\n789\n", text
        else:              # O sees the boards after X's moves
            assert obs == "X23\n456\n789\nXOX\n456\n789\nXOX\nOX6\n789\n", text
        own = eps["turn_ids"][i][eps["model_mask"][i]]
        assert sorted(set(own.tolist())) == list(range(eps["turns"][i]))
        assert eps["counters"][i]["moves"] == eps["turns"][i]
    # The whole rollout: RAE per seat, sampler == trainer log-probs over each seat's row.
    seen = watch_rows(rollout)
    batch, metrics = rollout(state, 0)
    rows = seen.rows
    np.testing.assert_array_equal(batch["loss_mask"], batch["model_mask"])
    np.testing.assert_allclose(batch["advantages"],
                               rows["rewards"] - batch["role_baseline"][rows["roles"]],
                               rtol=1e-6, atol=1e-6)
    assert metrics["rollout/logp_diff_max"] < 1e-4
    assert metrics["env/wins_X_mean"] == 0.5 and metrics["env/losses_mean"] == 0.5
    sel, picked = cfg.data.selection, rollout.selector.last_indices
    want = {}
    for index in picked:
        for wins in (g, 0):   # the game's X group, then its O group
            a, b = want.pop(index, (sel.prior_a, sel.prior_b))
            want[index] = selection.beta_update(a, b, wins, g, decay=sel.decay,
                                                prior_a=sel.prior_a, prior_b=sel.prior_b)
    assert len(picked) == 2 and rollout.selector.posteriors == want


def test_selfplay_with_ppo_trains_each_seat_and_resumes_exactly(tmp_path, lowest_cell):
    """PPO with a critic in self-play: a rollout plays batch / (seats x G) games, each seat of
    a match a row with its own return (X wins every game here: +1 for X's rows, -1 for O's),
    and a run stopped after its first iteration and resumed equals the straight one."""
    from rljax.train.phases import ppo
    cfg = lambda: ttt_cfg(**{"env.selfplay.mode": "self", "algo.name": "ppo",  # noqa: E731
                             "algo.adv_estimator": "gae", "algo.num_generations": 2})
    setup.check_inputs(cfg(), num_devices=1)
    ctx = setup.build_context(cfg(), str(tmp_path / "phase"), devices=DEVICES)
    phase = ppo.PPOPhase(ctx, 2)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    rnd = phase.rollout.rounds.sample_round(phase.rollout, state.params, jax.random.key(1))
    roles = np.tile(np.repeat([0, 1], 2), 2)   # 2 games x 2 seats x G = the batch's 8 rows
    np.testing.assert_array_equal(rnd["episodes"]["roles"], roles)
    np.testing.assert_array_equal(rnd["rewards"], np.where(roles == 0, 1.0, -1.0))
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1, devices=DEVICES)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert len(rl) == 2 and all(r["critic_grad_norm"] > 0 for r in rl)


def test_selfplay_in_a_chat_template_opens_the_second_seat_on_its_first_observation(
        tmp_path, lowest_cell):
    """In a chat template the seat that moves second has no turn before it first sees the
    board: its prompt ends with its user message (no assistant header) and its first chunk is
    the board as a user message, then the header. Each row is what the template renders for
    its seat's messages, and the sampler's log-probs are the trainer's."""
    g = 2
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.num_generations": g,
                     "tokenizer.chat_template": True, "data.max_prompt_length": 48,
                     "env.max_obs_tokens": 40, "env.max_total_tokens": 224,
                     "model.overrides.max_position_embeddings": 288})
    ctx, phase, state = _phase(cfg, tmp_path)
    rollout = episode_rollout(ctx, setup.rl_iterator(ctx, 2))
    rnd = rollout.sample_round(state.params, jax.random.key(3))
    eps, tok = rnd["episodes"], ctx.tokenizer
    seat = np.repeat(np.tile([0, 1], 2), g)
    np.testing.assert_array_equal(eps["env_rewards"], np.where(seat == 0, 1.0, -1.0))
    assert not eps["truncated"].any()
    boards = {0: ["XO3\n456\n789\n", "XOX\nO56\n789\n", "XOX\nOXO\n789\n"],
              1: ["X23\n456\n789\n", "XOX\n456\n789\n", "XOX\nOX6\n789\n"]}
    for i in range(len(seat)):
        s = int(seat[i])
        user = ("tictactoe X\n123\n456\n789\n", "tictactoe O\n")[s]
        assert eps["prompts"][i] == tok.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=s == 0)
        # The row as turns: the model's own moves between the observations.
        ids, model = eps["tokens"][i][eps["mask"][i]], eps["model_mask"][i][eps["mask"][i]]
        runs, start = [], 0
        for k in range(1, len(ids) + 1):
            if k == len(ids) or model[k] != model[start]:
                runs.append((bool(model[start]), tok.decode(ids[start:k].tolist())))
                start = k
        moves = [text for is_model, text in runs if is_model]
        messages = [{"role": "user", "content": user}]
        for k, board in enumerate(boards[s]):
            if s == 1:
                messages.append({"role": "user", "content": board})
            messages.append({"role": "assistant", "content": moves[k]})
            if s == 0 and k < len(boards[s]):
                messages.append({"role": "user", "content": board})
        messages.append({"role": "assistant", "content": moves[-1]}) if s == 0 else None
        assert len(moves) == (4, 3)[s]
        assert eps["prompts"][i] + "".join(text for _, text in runs) + "\n" == \
            tok.apply_chat_template(messages, add_generation_prompt=False), runs
    batch, metrics = rollout(state, 0)
    assert metrics["rollout/logp_diff_max"] < 1e-4


def test_a_scripted_trace_of_the_second_seat_is_laid_out_as_its_rollout():
    """``trace_tokens`` on ``[user, user: board, assistant, ...]``: the prompt ends with the
    first user message (no header), the board is the first observation, as in a rollout."""
    from rljax.tokenizers import CharTokenizer
    from rljax.train.core.render import Renderer, trace_tokens
    tok = CharTokenizer()
    renderer = Renderer(tok, chat=True)
    messages = [{"role": "user", "content": "tictactoe O\n"},
                {"role": "user", "content": "X23\n456\n789\n"},
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "XOX\n456\n789\n"},
                {"role": "assistant", "content": "4"}]
    prompt, ids, model = trace_tokens(tok, renderer, messages)
    assert tok.decode(prompt) == "User: tictactoe O\n\n"
    first = [k for k in range(len(ids)) if model[k]][0]
    assert tok.decode(ids[:first]) == "User: X23\n456\n789\n\nAssistant: "
    assert tok.decode(prompt + ids, skip_special=True) + "\n" == \
        tok.apply_chat_template(messages, add_generation_prompt=False)
    # The seat that moves first: one user message, the prompt ends with the header.
    prompt, ids, model = trace_tokens(tok, renderer, messages[1:])
    assert tok.decode(prompt) == "User: X23\n456\n789\n\nAssistant: " and model[0]


def test_negotiation_selfplay_pays_each_seat_its_share(tmp_path, monkeypatch):
    """Negotiation (not zero-sum) with one policy in both seats: every turn plays the fair
    negotiator's move, so each row's reward is its seat's share of the deal the two fair
    seats reach, read from the values each seat's prompt shows; role keys 4 (P1), 5 (P2)."""
    from rljax.envs import board_games as bg
    from rljax.envs.selfplay import SeatEnv
    step = SeatEnv.step
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(
        self, bg.negotiation_fair(self.game, self.match.state)))
    g = 2
    cfg = config_lib.load_config("configs/grpo_negotiation_selfplay.py", [
        "sft.steps=0", "rollout.batch_size=8", f"algo.num_generations={g}", "mesh.data=1",
        "model.overrides.num_layers=1", "model.overrides.hidden_size=32",
        "model.overrides.intermediate_size=64", "logging.tensorboard=False"])
    ctx, phase, state = _phase(config_lib.validate(cfg), tmp_path)
    eps = episode_rollout(ctx, setup.rl_iterator(ctx, 2)).sample_round(
        state.params, jax.random.key(0))["episodes"]
    seat = np.repeat(np.tile([0, 1], 2), g)
    np.testing.assert_array_equal(eps["roles"], 4 + seat)
    assert (eps["env_rewards"] > 0).all()   # the fair seats strike a deal in every match
    game = bg.Negotiation()
    for i in range(0, len(seat), 2 * g):   # one match per example: P1's rows, then P2's
        views = [eps["prompts"][k] + eps["transcripts"][k] for k in (i, i + g)]
        deal = tuple(tuple(int(x) for x in re.search(r"values (\d) (\d) (\d)", v).groups())
                     for v in views)
        state_ = game.initial(deal)
        while not game.is_terminal(state_):
            state_ = game.apply(state_, bg.negotiation_fair(game, state_))
        for j in range(2 * g):
            assert eps["env_rewards"][i + j] == pytest.approx(game.returns(state_)[seat[i + j]])


@pytest.mark.slow
def test_selfplay_sharded_on_8_devices_equals_unsharded(tmp_path):
    """One self-play RAE iteration on a data x fsdp x tensor = 2x2x2 mesh of 8 fake devices
    plays the same games as on one device (same rewards, wins and turns), and its update
    lands on the same parameters (float32 rounding apart)."""
    overrides = {"env.selfplay.mode": "self", "algo.adv_estimator": "rae", "steps": 1,
                 "algo.num_generations": 2}
    one, eight = str(tmp_path / "one"), str(tmp_path / "eight")
    assert run.train(ttt_cfg(**overrides), one, devices=DEVICES) == 0
    sharded = ttt_cfg(**overrides, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    assert run.train(sharded, eight, devices=jax.devices()[:8]) == 0
    rl = [[r for r in read_metrics(w) if "reward/mean" in r] for w in (one, eight)]
    assert len(rl[0]) == len(rl[1]) == 1
    exact = [k for k in rl[0][0] if k.startswith(("reward/", "env/", "rae/"))]
    assert "env/turns_mean" in exact and any(k.startswith("env/wins") for k in exact), exact
    assert {k: rl[1][0][k] for k in exact} == {k: rl[0][0][k] for k in exact}
    assert rl[1][0]["loss"] == pytest.approx(rl[0][0]["loss"], rel=1e-4, abs=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 final_params(eight), final_params(one))


# ----------------------------------------------------------------------------- frozen opponent


@pytest.mark.parametrize("allocation", ["uniform", "knapsack"])
def test_checkpoint_opponent_plays_the_other_seat_and_never_trains(rae_run, tmp_path,
                                                                   lowest_cell, allocation):
    """env.selfplay.mode='checkpoint': the policy's rows are the examples' seats (the batch),
    the frozen run (its checkpoint's parameters, loaded once) plays the other seat, whose
    moves the policy sees as observations. With knapsack allocation a game's group is G_i
    matches of the policy's seat (the flat prior's 2 each here)."""
    from rljax.train.methods import selfplay
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods.agent import EpisodeRounds
    from rljax.train.methods.allocation import KnapsackRounds
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
                     "rollout.allocation": allocation, "rollout.knapsack.min_samples": 1})
    ctx, phase, state = _phase(cfg, tmp_path)
    rollout = phase.rollout   # the phase's rollout is the plain one, the episodes its rounds
    source = KnapsackRounds if allocation == "knapsack" else EpisodeRounds
    assert type(rollout) is Rollout and isinstance(rollout.rounds, source)
    opponent = (rollout.rounds.episodes if allocation == "knapsack" else rollout.rounds).opponent
    assert opponent is not None
    jax.tree.map(np.testing.assert_array_equal, opponent.params, _baseline(rae_run)[1])
    seen = watch_rows(rollout)
    batch, metrics = rollout(state, 0)
    rows = seen.rows
    assert len(rows["rewards"]) == cfg.rollout.batch_size
    seats = rows["roles"]   # tictactoe: role key = seat
    np.testing.assert_array_equal(rows["rewards"], np.where(seats == 0, 1.0, -1.0))
    np.testing.assert_array_equal(rows["turns"], np.where(seats == 0, 4, 3))
    assert metrics["env/games_X_mean"] + metrics["env/games_O_mean"] == 1.0
    assert batch["loss_mask"].sum() == rows["model_mask"].sum() > 0
    if allocation == "knapsack":
        assert metrics["rollout/group_size_mean"] == 2.0
        return
    with pytest.raises(setup.UserError, match="env.selfplay.step=7 is not saved"):
        selfplay.opponent_from_workdir(ctx, rae_run, 7)
    with pytest.raises(setup.UserError, match="cannot read the run.s config.json"):
        selfplay.opponent_from_workdir(ctx, str(tmp_path))


def test_checkpoint_opponent_on_the_slot_engine_plays_the_static_matches(
        rae_run, tmp_path, lowest_cell, monkeypatch):
    """rollout.engine='slots' with a checkpoint opponent: the policy's and the opponent's seats
    each on an episode engine of their own (slots, cache, params), both sampling (opponent at
    temperature 1); every row draws the static plies' noise, so both sides' rows are the
    static loop's: tokens, masks, log-probs, outcomes. In-flight weights reach the policy's
    side only."""
    import dataclasses
    from rljax import data as data_lib
    from rljax.train.core import evaluate
    from rljax.train.methods import agent, matches, selfplay
    over = {"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
            "env.selfplay.temperature": 1.0}
    cfg = ttt_cfg(**over, **{"rollout.engine": "slots", "rollout.chunk_steps": 3})
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    opponent = selfplay.load_opponent(ctx)
    template = data_lib.make_template(ctx.data_config(), ctx.tokenizer)
    played = []   # both sides' dicts (play keeps the policy's)
    monkeypatch.setattr(selfplay, "run_matches", lambda *a, **k: played.append(
        matches.run_matches(*a, **k)) or played[-1])
    static_ctx = dataclasses.replace(ctx, cfg=ttt_cfg(**over))
    # In-flight weights (version 7, the same params) reach the policy's side only.
    for c, weights in ((static_ctx, None), (ctx, None), (ctx, lambda: (ctx.params, 7))):
        selfplay.play(c, ctx.params, evaluate.eval_examples(ctx), jax.random.key(3),
                      num_samples=2, temperature=1.0, template=template, opponent=opponent,
                      weights=weights, **agent.match_options(c.cfg, c))
    mine, theirs = played[2]
    assert "versions" not in theirs and "versions" not in played[1][0]
    np.testing.assert_array_equal(mine["versions"][mine["model_mask"]], 7)
    for static, slots in [*zip(played[0], played[1]), *zip(played[0], played[2])]:
        assert static["turns"].max() > 1
        for k in ("tokens", "mask", "model_mask", "turn_ids", "turns", "env_rewards",
                  "turn_rewards", "truncated", "roles", "counters"):
            np.testing.assert_array_equal(slots[k], static[k], err_msg=k)
        np.testing.assert_allclose(slots["logps"], static["logps"], rtol=1e-4, atol=1e-5)


def test_checkpoint_opponent_with_partial_rollouts_resumes_exactly(rae_run, tmp_path,
                                                                   lowest_cell):
    """rollout.partial with a checkpoint opponent: whole games (every seat plays the lowest
    free cell) carried across iterations mid-game, the opponent's seats on an engine of
    their own; the opponent's recorded moves replay with the policy's when a match is
    rebuilt, only the example's seat's group trains, RAE's baselines move with the groups
    as they complete, and a run stopped after its first iteration and resumed equals the
    straight one (baselines included)."""
    from tests.test_episode_partial import watch_carried
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
                     "algo.adv_estimator": "rae",
                     "env.selfplay.temperature": 1.0, "rollout.engine": "slots",
                     "rollout.partial": True, "rollout.chunk_steps": 2,
                     "rollout.max_new_tokens": 2, "rollout.max_staleness": 1})
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    with pytest.MonkeyPatch.context() as mp:
        carried = watch_carried(mp)
        assert run.train(cfg, straight, devices=DEVICES) == 0
    # Matches carried mid-game: both seats (policy and opponent) with moves played.
    assert any(rows.count(0) < len(rows) - 1 for places in carried for rows in places), carried
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert len(rl) == 2 and rl[1]["rollout/staleness_max"] == 1
    assert all(r["env/plies_mean"] == 7 and r["rollout/carried_groups"] > 0 for r in rl)
    # The batch is the policy's seats only: X's rows win, O's lose; both seats were drawn.
    assert all(r["reward/mean"] == r.get("env/games_X_mean", 0) - r.get("env/games_O_mean", 0)
               for r in rl) and any(r.get("env/games_O_mean", 0) > 0 for r in rl)
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(rl[0]["step"])) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed), final_params(straight))
    baseline = _baseline(straight)[0]
    assert np.abs(baseline).max() > 0 and any(k.startswith("rae/baseline_") for k in rl[1])
    np.testing.assert_array_equal(_baseline(resumed)[0], baseline)


def test_checkpoint_opponent_with_knapsack_partial_rollouts_trains(rae_run, tmp_path,
                                                                   lowest_cell, monkeypatch):
    """Knapsack allocation with partial rollouts against a checkpoint opponent: a place holds
    room for max_samples = G matches of its game and plays the first G_i the knapsack gave
    it (both seats' rows of those; the others never move), carried mid-game; the example's
    seat's G_i rows train as its group."""
    from rljax.train.methods.episode_partial import EpisodePartialRounds
    unplayed, taken = [], []   # per round: turns of rows past a size; the round's sizes
    sample_round = EpisodePartialRounds.sample_round

    def spy(self, rollout, params, rng=None):
        rnd = sample_round(self, rollout, params, rng)
        taken.append(rnd["group_sizes"])
        unplayed.append(sum(len(self.turns[j][k]) for j in np.flatnonzero(self.serial >= 0)
                            for k in range(self.rows) if k % self.g >= self.sizes[j]))
        return rnd
    monkeypatch.setattr(EpisodePartialRounds, "sample_round", spy)
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
                     "env.selfplay.temperature": 1.0, "rollout.engine": "slots",
                     "rollout.partial": True, "rollout.chunk_steps": 2,
                     "rollout.max_new_tokens": 2, "rollout.max_staleness": 1,
                     "rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 1,
                     "rollout.knapsack.max_samples": 2, "rollout.knapsack.budget": 6})
    ctx, phase, state = _phase(cfg, tmp_path)
    records = []
    for step in range(2):
        state, metrics = phase.iteration(state, step)
        records.append(metrics)
    sizes = np.concatenate(taken)   # the first 4 to complete, of batches of 6 in room for 8
    assert set(sizes.tolist()) == {1, 2} and len(sizes) == 8
    assert unplayed and not any(unplayed)
    assert all(np.isfinite(r["loss"]) and r["env/plies_mean"] == 7
               and r["rollout/carried_groups"] == 4 for r in records)
    assert records[1]["rollout/staleness_max"] == 1   # carried mid-game


@pytest.mark.parametrize("engine", ["static", "slots", "knapsack", "inflight", "hints"])
def test_checkpoint_opponent_tree_forks_the_learner_seats_first_turn(rae_run, tmp_path,
                                                                    monkeypatch, engine):
    """rollout.tree with a checkpoint opponent (the static tree sampler, or the slot engine
    serving its forks): a group's 4 matches share their opening (O's wait for the opponent's
    first move, played once), the learner seat's first turns are one tree's leaves (2 roots
    of one token, each forked in 2), every match is played on to its end, and treepo's
    advantages read the leaves' seat rewards over that tree; the decoded tokens count a
    root's token once. Knapsack allocation: a game's
    group is trees of one root (2 leaves), each with an opening of its own, under GRPO.
    In-flight weight updates: every learner token, the tree's too, records its version.
    Hints (every group fails, threshold 2): each group is played again as a new tree, its
    opening replayed, the hint after the learner seat's first observation (the tree grows
    from it), and the hinted trees' leaves are what trains."""
    from rljax import algorithms
    from rljax.envs.selfplay import SeatEnv
    from rljax.sampling import tree as tree_sampling
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods import guidance, tree_matches
    step = SeatEnv.step   # every turn plays the legal cell its text picks: leaves' games differ
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(self, (
        cells := self.game.legal_moves(self.match.state))[sum(map(ord, text)) % len(cells)]))
    played, seen, real_play, real_adv = [], [], tree_matches.play_tree, Rollout.advantages
    hints, guided = [], []   # each call's learner hints (None: not hinted); guided rounds
    after_round = guidance.Guide.after_round
    monkeypatch.setattr(guidance.Guide, "after_round", lambda *a: guided.append(
        after_round(*a)) or guided[-1])

    def play_tree(*a, **k):
        hints.append(k["sides"][0].prefixes)
        out = real_play(*a, **k)
        played.append(copied(out))
        return out
    monkeypatch.setattr(tree_matches, "play_tree", play_tree)
    monkeypatch.setattr(Rollout, "advantages", lambda self, rewards, **kw: seen.append(
        (np.asarray(rewards), real_adv(self, rewards, **kw))) or seen[-1][1])
    knapsack = {"rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 2,
                "algo.adv_estimator": "grpo"} if engine == "knapsack" else {}
    inflight = {"algo.asynchronous": True, "algo.inflight_updates": True} if (
        engine == "inflight") else {}
    hinted = {"algo.hint.mode": "fixed", "algo.hint.fraction": 1.0,
              "algo.hint.threshold": 2.0, "sft.trace_noise": 0.0} if engine == "hints" else {}
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
                     "env.selfplay.temperature": 1.0, "rollout.slots": 3,
                     "rollout.engine": "static" if engine in ("static", "knapsack", "hints")
                     else "slots",
                     "algo.adv_estimator": "treepo",
                     "algo.num_generations": 4, "rollout.tree.enabled": True,
                     "rollout.tree.roots": 2, "rollout.tree.branching": 2,
                     "rollout.tree.segment_tokens": 1, **knapsack, **inflight, **hinted})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
    assert inflight or all(r["rollout/logp_diff_max"] < 1e-4 for r in rl)   # the tree's
    assert len(played) == (4 if hinted else 2) and len(seen) == 2
    if engine in ("static", "slots"):   # a tree's 2 one-token roots sampled once, not per leaf
        assert all(r["rollout/decoded_tokens"] == r["rollout/train_tokens"] - 2 * 2 for r in rl)
    if hinted:   # a round's trees, then its hinted trees: those train
        assert all(r["hint/fraction_hinted"] == 1.0 for r in rl)
        assert [h is not None for h in hints] == [False, True] * 2
        check_hinted_trees(guided, played[1::2], hints[1::2], cfg)
    shared = 2 if knapsack else 4   # the rows of one played group: one opening
    openings = []
    for n, eps in enumerate(played):
        assert len(eps["tokens"]) == 8 and not eps["truncated"].any()
        assert (eps["turns"] >= 2).all()   # games played on after the tree's first turns
        start = np.argmax(eps["turn_ids"] == 0, axis=1)   # the first turn's column
        first = eps["tokens"][np.arange(8), start].reshape(4, 2)   # (root, leaf)
        assert (first[:, 0] == first[:, 1]).all()   # a root's leaves share its segment
        for group in range(0, 8, shared):   # a tree's matches share the opening before it
            assert len(set(start[group:group + shared])) == 1
            prefix = eps["tokens"][group:group + shared, :start[group]]
            assert (prefix == prefix[:1]).all()
            if hints[n] is None:   # (a hinted tree's first turn follows its hint)
                openings.append(start[group])
    assert max(openings) > 0 and min(openings) == 0   # both seats: O after X's opening
    if inflight:   # (the second batch is sampled while the first trains)
        eps = played[-1]
        assert (eps["versions"][eps["model_mask"]] >= 0).all() and eps["swaps"] >= 0
        return
    if knapsack:
        assert all(r["rollout/group_size_mean"] % 2 == 0 for r in rl)
        return
    node_ids = np.tile(tree_sampling.tree_layout(2, 2, 1)[0], (2, 1))
    for rewards, adv in seen:
        np.testing.assert_allclose(adv, algorithms.treepo_advantages(
            rewards, 4, node_ids=node_ids), atol=1e-6)
    assert any(np.abs(adv).max() > 0 for _, adv in seen)


def copied(eps: dict) -> dict:
    """``eps`` with its arrays copied (a hinted group overwrites its round's rows in place)."""
    return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in eps.items()}


def check_hinted_trees(rounds: list, played: list, hints: list, cfg) -> None:
    """The guided ``rounds`` train the hinted trees ``played`` (learner rows, their
    ``hints``): each row's hint is its group's seat's scripted first move, right before the
    learner's first turn (after the opening), context (not the model's)."""
    from rljax.train.methods import agent
    tok, g = setup.make_tokenizer(cfg, None), int(cfg.algo.num_generations)
    for rnd, eps, prefixes in zip(rounds, played, hints):
        assert rnd["hint"]["hinted"] == rnd["hint"]["groups"] == len(eps["tokens"]) // g
        np.testing.assert_array_equal(rnd["tokens"], eps["tokens"])   # the hinted trees train
        for row, hint in enumerate(prefixes):
            assert hint == rnd["hint_prefixes"][row] == tok.encode(
                agent.reference_turn(cfg, rnd["examples"][row // g]))
            first = int(np.argmax(eps["model_mask"][row]))
            np.testing.assert_array_equal(eps["tokens"][row][first - len(hint):first], hint)
            assert not eps["model_mask"][row][first - len(hint):first].any()


def test_checkpoint_opponent_trees_with_partial_rollouts_are_carried_whole(rae_run, tmp_path,
                                                                          monkeypatch):
    """rollout.tree with partial rollouts against a checkpoint opponent (slot engine): a
    fresh place plays its game's opening once, replays it into its 4 matches and grows the
    learner seat's first turns as one tree (2 roots of one token, each forked in 2),
    recorded as the opponent's and its rows' first steps; the matches are then played on
    and carried mid-game, rebuilt by replaying every step, the tree's included. The groups
    that train share their opening and hold the tree's leaves, and the pool saved after the
    first iteration and resumed equals the straight run."""
    from rljax.envs.selfplay import SeatEnv
    from rljax.train.methods import tree_matches
    from rljax.train.methods.episode_partial import EpisodePartialRounds
    from tests.test_episode_partial import watch_carried
    from tests.test_knapsack import phase_resumes_exactly
    step = SeatEnv.step   # every turn plays the legal cell its text picks: leaves' games differ
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(self, (
        cells := self.game.legal_moves(self.match.state))[sum(map(ord, text)) % len(cells)]))
    trained, openings, scored = [], [], EpisodePartialRounds.scored_round
    real_openings = tree_matches.play_openings
    monkeypatch.setattr(tree_matches, "play_openings", lambda *a, **k: openings.append(
        real_openings(*a, **k)) or openings[-1])

    def spy(self, rollout, eps, examples, *args, **kw):
        trained.append({k: eps[k] for k in ("tokens", "turn_ids", "turns")})
        return scored(self, rollout, eps, examples, *args, **kw)
    monkeypatch.setattr(EpisodePartialRounds, "scored_round", spy)
    carried = watch_carried(monkeypatch)
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": rae_run,
                     "env.selfplay.temperature": 1.0, "rollout.engine": "slots",
                     "rollout.partial": True, "rollout.chunk_steps": 2, "rollout.slots": 3,
                     "rollout.max_staleness": 1, "algo.adv_estimator": "treepo",
                     "algo.num_generations": 4, "rollout.tree.enabled": True,
                     "rollout.tree.roots": 2, "rollout.tree.branching": 2,
                     "rollout.tree.segment_tokens": 1})
    records = phase_resumes_exactly(cfg, tmp_path, steps=3, saved_after=2)
    assert all(np.isfinite(r["loss"]) and r["rollout/carried_groups"] > 0 for r in records)
    assert records[0]["rollout/logp_diff_max"] < 1e-4   # the trees' log-probs as sampled
    assert all(r["rollout/staleness_max"] == 1 for r in records[1:])   # carried trees trained
    # Places carried at the tree's boundary: its 4 leaves recorded as the learner's first
    # turns (and X's opening move before O's tree), rebuilt and played on the next iteration.
    assert [1, 1, 1, 1, 1, 1, 1, 1] in carried[2] and [1, 1, 1, 1, 0, 0, 0, 0] in carried[2]
    # One opening a fresh place (X's first move, or none: X learns): 4, 2, 2 and the resumed
    # iteration's 2.
    assert len(openings) == 10 and {len(plies) for (plies,) in openings} == {0, 1}
    assert len(trained) == 4   # the straight iterations, the resumed one again
    starts = []
    for eps in trained:
        assert (eps["turns"] >= 2).all()   # games played on after the tree's first turns
        start = np.argmax(eps["turn_ids"] == 0, axis=1)   # the first turn's column
        first = eps["tokens"][np.arange(8), start].reshape(4, 2)   # (root, leaf)
        assert (first[:, 0] == first[:, 1]).all()   # a root's leaves share its segment
        for group in (0, 4):   # a group's matches share the opening before its tree
            assert len(set(start[group:group + 4])) == 1
            prefix = eps["tokens"][group:group + 4, :start[group]]
            assert (prefix == prefix[:1]).all()
        starts += start.tolist()
    assert max(starts) > 0 and min(starts) == 0   # both seats: O after X's opening


def test_evaluation_against_fixed_opponents_reports_wilson_intervals(rae_run, tmp_path):
    """Scripted and checkpoint opponents: every game is a win, draw, loss or the opponent's
    forfeit; rates come with their Wilson intervals."""
    from rljax.envs import wilson_interval
    from rljax.train.core import evaluate
    from rljax.train.methods import game_eval, selfplay
    # Published values of the 95% Wilson interval.
    for k, n, want in ((5, 10, (0.2366, 0.7634)), (0, 10, (0.0, 0.2775)),
                       (10, 10, (0.7225, 1.0))):
        np.testing.assert_allclose(wilson_interval(k, n), want, atol=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    ctx, phase, state = _phase(ttt_cfg(), tmp_path)
    examples = evaluate.eval_examples(ctx)
    opponent = selfplay.opponent_from_workdir(ctx, rae_run)
    for opp in ("random", "optimal", opponent):
        m = game_eval.evaluate_games(ctx, state.params, examples, opp, jax.random.key(0))
        assert m["games/games"] == len(examples) == 4
        total = sum(m[f"games/{k}"] for k in ("wins", "draws", "losses", "opponent_forfeits"))
        assert total + m["games/truncated"] == pytest.approx(1.0)
        for k in ("wins", "draws", "losses"):
            k_games = round(m[f"games/{k}"] * 4)
            assert m[f"games/{k}_ci95"] == list(wilson_interval(k_games, 4))
    with pytest.raises(ValueError, match="opponent must be one of"):
        game_eval.evaluate_games(ctx, state.params, examples, "minimax", jax.random.key(0))


def test_seat_envs_share_a_match_and_each_sees_only_its_seat():
    """Pure Python: the seats of one match take turns, each sees its own view (Kuhn Poker: its
    own card only), a finished game pays each seat its return, a forfeit pays the forfeiting
    seat the penalty and the other ``forfeit_reward``."""
    from rljax.envs import board_games as bg
    from rljax.envs.selfplay import Match, SeatEnv, seat_example
    poker = bg.get_game("kuhn_poker")
    match = Match(poker, deal=(2, 0))   # P1 holds K, P2 holds J
    p1 = SeatEnv(match, {"question": "kuhn_poker P1\n"}, 0)
    p2 = SeatEnv(match, {"question": "kuhn_poker P2\n"}, 1)
    assert p1.reset() == [{"role": "user", "content": "kuhn_poker P1\ncard K, moves: -\n"}]
    assert p2.reset() == [{"role": "user", "content": "kuhn_poker P2\n"}]
    assert p1.to_move() and not p2.to_move() and p1.role_key == 2 and p2.role_key == 3
    assert p1.step("I bet").reward == 0.0 and not p1.done
    assert p2.observe() == [{"role": "user", "content": "card J, moves: bet\n"}]   # no K
    with pytest.raises(ValueError):
        p1.step("call")                     # not P1's turn
    last = p2.step("call")
    assert (last.reward, last.done, last.info["losses"]) == (-2.0, True, 1)
    won = p1.finish()
    assert (won.reward, won.done, won.info["wins_P1"]) == (2.0, True, 1)
    # A forfeit: X names an occupied cell.
    ttt = bg.get_game("tictactoe")
    match = Match(ttt)
    x, o = (SeatEnv(match, seat_example({"question": "tictactoe X\n", "seat": 0}, s, ttt), s,
                    illegal_penalty=-2.0, forfeit_reward=0.5) for s in (0, 1))
    assert o.example["question"] == "tictactoe O\n" and o.example["seat_name"] == "O"
    x.reset(), o.reset()
    x.step("5"), o.step("1")
    lost = x.step("1")
    assert (lost.reward, lost.done, lost.info["illegal_moves"]) == (-2.0, True, 1)
    assert not o.to_move()
    other = o.finish()
    assert (other.reward, other.done, other.info["opponent_forfeits"]) == (0.5, True, 1)


@pytest.mark.parametrize("overrides,needle", [
    ({"env.selfplay.mode": "checkpoint"}, "env.selfplay.workdir (the opponent's run) goes"),
    ({"env.selfplay.workdir": "runs/x"}, "is read with env.selfplay.mode='checkpoint'"),
    ({"env.selfplay.mode": "self", "rollout.batch_size": 12, "algo.num_generations": 4},
     "must be divisible by algo.num_generations * seats = 8"),
    ({"env.selfplay.mode": "self", "env.name": "guess_number"}, "plays board games"),
    ({"env.selfplay.mode": "best"}, "env.selfplay.mode"),
    ({"env.selfplay.mode": "self", "data.selection.name": "curriculum"},
     "a game has none"),
])
def test_selfplay_config_errors_are_one_line(overrides, needle):
    with pytest.raises(config_lib.ConfigError, match=re.escape(needle)) as e:
        ttt_cfg(**overrides)
    assert "\n" not in str(e.value)


def test_a_prompt_the_environment_renders_too_long_is_one_line_before_training(tmp_path):
    """Kuhn Poker against the scripted opponent: a second mover's prompt holds the first
    mover's bet, 35 tokens against a 32-token prompt limit. The run stops before anything is
    compiled or written, naming the limit, instead of at the first eval that draws it."""
    cfg = ttt_cfg(**{"data.source": "kuhn_poker", "env.name": "kuhn_poker", "env.max_turns": 2,
                     "env.max_turn_tokens": 6, "env.max_obs_tokens": 28,
                     "rollout.max_new_tokens": 6, "data.max_prompt_length": 32,
                     "eval.num_examples": 8, "eval.batch_size": 8,
                     "env.kwargs": {"opponent": "random", "illegal_penalty": -2.0}})
    with pytest.raises(setup.UserError, match=r"has 3\d tokens as the environment renders it, "
                       r"over data.max_prompt_length=32") as e:
        run.train(cfg, str(tmp_path / "w"), devices=DEVICES)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "w" / "checkpoints").exists()
    cfg.data.max_prompt_length = 48   # fits: the check passes (and a run could start)
    from rljax.train.methods import agent
    from rljax.train.core import evaluate
    ctx = setup.build_context(config_lib.validate(cfg), str(tmp_path / "x"), devices=DEVICES)
    agent.check_episode_prompts(ctx, evaluate.eval_examples(ctx))


def test_kuhn_strategy_scores_each_information_set_as_its_rollout_row_lays_it_out(tmp_path):
    """``bench/kuhn_strategy.py``: the 12 information sets, each as the chat template renders
    that seat's messages (the second seat's prompt without a header), and each legal move's
    probability the model's own softmax over the reply's tokens."""
    import importlib.util
    import os

    import jax.numpy as jnp

    from rljax import models
    spec = importlib.util.spec_from_file_location(
        "kuhn_strategy", os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench",
                                      "kuhn_strategy.py"))
    ks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ks)
    cfg = config_lib.load_config("configs/grpo_kuhn_selfplay.py", [
        "steps=1", "sft.steps=0", "tokenizer.chat_template=True", "logging.tensorboard=False",
        "model.overrides.num_layers=1", "model.overrides.hidden_size=32",
        "model.overrides.intermediate_size=64"])
    ctx, _, state = _phase(config_lib.validate(cfg), tmp_path)
    tok = ctx.tokenizer
    contexts = ks.infoset_contexts(cfg, tok)
    assert [(s, c, " ".join(h)) for s, c, h, _, _ in contexts][:4] == [
        ("P1", "J", ""), ("P1", "Q", ""), ("P1", "K", ""), ("P2", "J", "check")]
    _, card, history, moves, ids = contexts[-1]      # P1 with K, after check bet
    assert (card, history, moves) == ("K", ("check", "bet"), ("call", "fold"))
    assert tok.decode(ids, skip_special=True) == tok.apply_chat_template(
        [{"role": "user", "content": "kuhn_poker P1\ncard K, moves: -\n"},
         {"role": "assistant", "content": "check"},
         {"role": "user", "content": "card K, moves: check bet\n"}], add_generation_prompt=True)
    assert tok.decode(contexts[3][4], skip_special=True) == tok.apply_chat_template(
        [{"role": "user", "content": "kuhn_poker P2\n"},
         {"role": "user", "content": "card J, moves: check\n"}], add_generation_prompt=True)

    def reply_probability(move):   # written out: a float64 log-softmax of the logits
        reply = tok.encode(move) + [tok.eos_id]
        logits = np.asarray(models.forward(ctx.model_cfg, state.params,
                                           jnp.asarray([ids + reply])), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return np.exp(sum(logp[len(ids) - 1 + k, t] for k, t in enumerate(reply)))

    rows = ks.strategy(ctx, state.params, contexts[-1:])
    p_call, p_fold = reply_probability("call"), reply_probability("fold")
    assert rows[0]["p_first"] == pytest.approx(p_call / (p_call + p_fold), rel=1e-4)
    assert rows[0]["legal_mass"] == pytest.approx(p_call + p_fold, rel=1e-4)


@pytest.mark.parametrize("mode", ["self", "checkpoint"])
def test_selfplay_on_the_slot_engine_plays_the_static_plies_games(tmp_path, request, mode):
    """env.selfplay.mode='self' or 'checkpoint' with rollout.engine='slots': every seat on a
    slot of its own (a checkpoint opponent's on an engine of its own), a seat's turn starting
    as soon as the other seat moved; each row draws the static plies' noise, so the games,
    rewards and updates are the static loop's. The checkpoint case (whole games: every seat
    plays the lowest free cell) stops after its first iteration and resumes."""
    overrides = {"env.selfplay.mode": mode, "algo.adv_estimator": "rae", "steps": 2,
                 "algo.num_generations": 2}
    stops = [None]
    if mode == "checkpoint":
        overrides["env.selfplay.workdir"] = request.getfixturevalue("rae_run")
        request.getfixturevalue("lowest_cell")
        stops = [StopAfter(1), None]
    static, slots = str(tmp_path / "static"), str(tmp_path / "slots")
    assert run.train(ttt_cfg(**overrides), static, devices=DEVICES) == 0
    for stop in stops:
        assert run.train(ttt_cfg(**overrides, **{"rollout.engine": "slots",
                                                  "rollout.chunk_steps": 3}),
                         slots, devices=DEVICES, stop=stop) == 0
    rl = [[r for r in read_metrics(w) if "reward/mean" in r] for w in (static, slots)]
    exact = [k for k in rl[0][0] if k.startswith(("reward/", "env/", "rae/"))]
    assert "env/turns_mean" in exact and any(k.startswith("env/wins") for k in exact), exact
    assert len(rl[0]) == len(rl[1]) == 2
    for a, b in zip(*rl):
        assert {k: b[k] for k in exact} == {k: a[k] for k in exact}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 final_params(slots), final_params(static))


def test_selfplay_with_distillation_scores_every_seat(tmp_path, lowest_cell):
    """``algo.name='distill'`` in self-play: the teacher scores each seat's row of a match as
    it scores any episode (the model's own tokens; the board is context), and the task
    reward of the seats is mixed in."""
    from tests.test_distill import write_teacher_workdir
    write_teacher_workdir(tmp_path / "teacher", cfg=ttt_cfg(), seed=7)
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.name": "distill", "algo.beta": 0.0,
                     "algo.distill.teacher": str(tmp_path / "teacher"),
                     "algo.distill.reward_weight": 0.5})
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path / "run")) if "distill/reverse_kl" in r]
    assert len(rl) == 2 and all(np.isfinite(r["distill/reverse_kl"]) and r["env/turns_mean"] > 1
                                and 0 <= r["distill/teacher_agreement"] <= 1 for r in rl)


def assert_routes_are_the_forwards(ctx, eps):
    """The rows' recorded routes ``eps["routes"]`` are the expert sets a full forward over
    prompt ++ trajectory routes each fed token to (a row's last token is never fed)."""
    import jax.numpy as jnp

    from rljax import models, sampling
    p = eps["prompt_len"]
    pt, pm = sampling.pad_to_bucket(eps["prompt_ids"], pad_id=0, buckets=(p,))
    tokens = np.concatenate([pt, eps["tokens"]], 1)
    mask = np.concatenate([pm, eps["mask"]], 1)
    assert eps["routes"].shape[:2] == tokens.shape and eps["model_mask"].any()
    _, _, stats = models.trunk(ctx.model_cfg, ctx.params, jnp.asarray(tokens),
                               jnp.asarray(mask), with_moe_stats=True)
    own = np.asarray(stats["ids"]).transpose(1, 2, 0, 3)          # [R, P+M, L, k]
    fed = mask.copy()
    fed[np.arange(len(fed)), p + eps["lengths"] - 1] = False      # the last token: never fed
    np.testing.assert_array_equal(np.sort(eps["routes"][fed], -1), np.sort(own[fed], -1))


@pytest.mark.parametrize("engine", ["static", "slots", "tree"])
def test_selfplay_routes_are_the_training_forwards(tmp_path, request, engine):
    """Routing replay in self-play (a mixture of experts): the matches record the experts of
    every token each learner seat fed (prompt, its moves, the boards it observed), on the
    static plies or the engines, laid out as the training row's columns: the sets a full
    forward over prompt ++ trajectory routes them to. ``tree``: against a checkpoint
    opponent with a tree of the learner seat's first turns (``tree_matches``), whose routes
    (prompt, opening, first turn) are the tree sampler's in its own prompt bucket."""
    from rljax import data as data_lib
    from rljax.sampling import tree as tree_sampling
    from rljax.train.core import evaluate
    from rljax.train.methods import agent, selfplay
    tree = {"env.selfplay.mode": "checkpoint", "rollout.tree.enabled": True,
            "env.selfplay.workdir": request.getfixturevalue("rae_run"),
            "env.selfplay.temperature": 1.0, "rollout.tree.segment_tokens": 1,
            "rollout.tree.branching": 2} if engine == "tree" else {}
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "model.preset": "tiny-moe",
                     "algo.routing_replay": True, "rollout.chunk_steps": 3,
                     "rollout.engine": "static" if tree else engine, **tree})
    cfg.model.overrides = dict(cfg.model.overrides, moe_intermediate_size=16, init_std=0.1)
    ctx = setup.build_context(config_lib.validate(cfg), str(tmp_path), devices=DEVICES)
    template = data_lib.make_template(ctx.data_config(), ctx.tokenizer)
    eps, _ = selfplay.play(ctx, ctx.params, evaluate.eval_examples(ctx)[:2], jax.random.key(3),
                           num_samples=2, temperature=1.0, template=template,
                           opponent=selfplay.load_opponent(ctx),
                           tree=tree_sampling.options_from_config(cfg.rollout.tree, 2),
                           **agent.match_options(ctx.cfg, ctx))
    assert_routes_are_the_forwards(ctx, eps)
    if engine != "slots":   # and a run replays them: the trainer's log-probs are the sampler's
        from rljax.train import run
        cfg.steps = 1
        assert run.train(config_lib.validate(cfg), str(tmp_path / "run"), devices=DEVICES) == 0
        (r,) = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
        assert r["rollout/logp_diff_max"] < 1e-4


def test_selfplay_with_relift_and_demonstrations_trains_on_each_seats_scripted_episode(
        tmp_path):
    """ReLIFT and mixed-policy demonstrations in self-play: a failed group of either seat gets
    that seat's scripted episode (``selfplay.seat_trace``: the scripted player in every seat,
    laid out as the seat's match row, so its prompt is the group's) as its last row, and
    ReLIFT's SFT step trains on the same episodes of the seats it buffered."""
    from rljax.train.core.render import trace_tokens
    from rljax.train.methods import agent, selfplay
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.mixed_policy": True,
                     "algo.relift.every": 1, "algo.relift.k_visits": 1,
                     "algo.relift.batch_size": 2, "sft.trace_noise": 0.0})
    # Seat O waits for X's move: the board reaches it as its first observation, as in a match.
    ex = {"question": "tictactoe O\n", "prompt": "tictactoe O\n", "seat": 1}
    messages, rewards = selfplay.seat_trace(cfg, ex, agent.env_kwargs(cfg))
    tok = setup.make_tokenizer(cfg, None)
    prompt, ids, model = trace_tokens(tok, agent.make_renderer(cfg, tok), messages)
    assert tok.decode(prompt) == "tictactoe O\n" and not model[0]
    assert sum(rewards) == 0.0 and len(rewards) == 4   # optimal play draws; O moves 4 times
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    rl = [r for r in read_metrics(workdir) if "reward/mean" in r]
    groups = cfg.rollout.batch_size // cfg.algo.num_generations
    # The untrained policy loses or forfeits every group: each (game, seat) group gets a demo.
    assert len(rl) == 2 and all(r["mixed/demos"] == groups for r in rl)
    assert all(r["relift/sft_rows"] > 0 and np.isfinite(r["relift/sft_loss"])
               and np.isfinite(r["loss"]) for r in rl)


def test_online_dpo_in_self_play_pairs_each_seats_best_and_worst(tmp_path):
    """Online DPO in self-play: a game gives a group per seat, and each group's best and worst
    episodes are a pair (scored on that seat's own moves); two iterations train."""
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.name": "dpo", "algo.online": True,
                     "algo.beta": 0.1, "algo.adv_estimator": "grpo"})
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path / "probe"), devices=DEVICES)
    from rljax.train.phases.dpo import DPOPhase
    import optax
    phase = DPOPhase(ctx, 2)
    state = create_train_state(ctx.params, optax.sgd(0.1), jax.random.key(0))
    batch, metrics = phase.rollout(state, 0)
    pairs = phase._group_pairs(batch, metrics)
    groups = cfg.rollout.batch_size // cfg.algo.num_generations   # 2 games x 2 seats
    assert len(pairs["pair_mask"]) == groups and "chosen_score_mask" in pairs
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    train = [r for r in read_metrics(str(tmp_path / "run")) if "rewards/margin" in r]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)


@pytest.mark.parametrize("engine", ["static", "slots", "ppo", "knapsack"])
def test_selfplay_hints_replay_a_failed_seats_group_with_the_hint_after_its_first_observation(
        tmp_path, monkeypatch, request, engine):
    """Hints in self-play: every group fails (threshold 2), so each (game, seat) group is
    played again in fresh matches, its seat's rows in the group's place, the hint (the seat's
    scripted first move, ``selfplay.seat_trace``) right after the seat's first observation:
    context in the trajectory (not the model's tokens), and the game judges hint + the
    sampled turn. An iteration trains on the hinted groups, on the static plies or the
    episode engine, under GRPO or PPO (its critic on the hinted rows); with knapsack
    allocation against a checkpoint opponent a game's group is re-sampled at its own size,
    the example's seat only."""
    from rljax.envs.board_games import get_game
    from rljax.train.methods import agent, allocation, guidance
    from rljax.train.methods.selfplay import seat_of
    g = 2
    extra = {"ppo": {"algo.name": "ppo", "algo.adv_estimator": "gae"},
             "knapsack": {"env.selfplay.mode": "checkpoint",
                          "env.selfplay.workdir": request.getfixturevalue("rae_run")
                          if engine == "knapsack" else "",
                          "rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 1,
                          "rollout.knapsack.max_samples": 2, "rollout.knapsack.budget": 6}
             }.get(engine, {})
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.hint.mode": "fixed",
                     "algo.hint.fraction": 1.0, "algo.hint.threshold": 2.0,
                     "sft.trace_noise": 0.0, "steps": 1,
                     "rollout.engine": "slots" if engine == "slots" else "static", **extra})
    seen = {}   # the guided rounds and their hinted re-samples (groups in the rounds' order)
    source = allocation.KnapsackRounds if engine == "knapsack" else agent.EpisodeRounds
    for cls, name in ((guidance.Guide, "after_round"), (source, "sample_hinted")):
        monkeypatch.setattr(cls, name, lambda *a, _f=getattr(cls, name), _n=name: seen.setdefault(
            _n, []).append(_f(*a)) or seen[_n][-1])
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    (r,) = [r for r in read_metrics(workdir) if "reward/mean" in r]
    assert r["hint/fraction_hinted"] == 1.0 and np.isfinite(r["loss"])
    assert engine != "ppo" or r["critic_grad_norm"] > 0
    rnd, eps = seen["after_round"][0], seen["sample_hinted"][0]["episodes"]
    tok, played, judged = setup.make_tokenizer(cfg, None), 0, 0
    if engine == "knapsack":   # groups of their own sizes, examples per row
        sizes = np.asarray(rnd["group_sizes"])
        assert len(set(sizes.tolist())) > 1 and rnd["hint"]["hinted"] == len(sizes)
        assert rnd["hint"]["samples"] == sizes.sum() == len(rnd["tokens"])
        example_of = rnd["examples"]
        seats = np.array([seat_of(get_game("tictactoe"), ex) for ex in example_of])
        assert len(set(seats.tolist())) == 2
        groups = len(sizes)
    else:
        groups = cfg.rollout.batch_size // g   # 2 games x 2 seats
        assert rnd["hint"]["hinted"] == groups and rnd["hint"]["samples"] == groups * g
        seats = np.tile(np.repeat([0, 1], g), 2)
        example_of = [rnd["examples"][row // g] for row in range(len(seats))]
    np.testing.assert_array_equal(rnd["roles"], seats)   # each group keeps its seat
    for row in range(len(seats)):
        hint = tok.encode(agent.reference_turn(cfg, example_of[row]))
        assert rnd["hint_prefixes"][row] == hint
        model = rnd["model_mask"][row]
        if not model.any():   # the other seat forfeited before this one moved
            continue
        played += 1
        first = int(np.argmax(model))
        np.testing.assert_array_equal(rnd["tokens"][row][first - len(hint):first], hint)
        assert not model[first - len(hint):first].any() and rnd["mask"][row][first - 1]
        if rnd["turns"][row] == 1:   # the game judged the hint and the sampled turn
            turn = rnd["tokens"][row][rnd["turn_ids"][row] == 0].tolist()
            assert eps["final_turns"][row] == tok.decode(hint + turn)
            judged += 1
    # (against the greedy checkpoint O's groups mostly see X forfeit before they move)
    assert played >= (1 if engine == "knapsack" else groups) and judged, (played, judged)


@pytest.mark.parametrize("mode", ["self", "hints", "demos", "checkpoint", "partial", "tree"])
def test_vineppo_in_selfplay_forks_replay_the_match_and_play_it_on(tmp_path, monkeypatch,
                                                                    request, mode,
                                                                    text_parity_cell):
    """VinePPO in self-play: a fork at a seat's turn rebuilds the match from its recorded
    turns, both seats', so its trajectory up to the fork is the row's (the boards the other
    seat's moves made included; a hinted row's hint after its first observation; a
    demonstration's the scripted match's, every seat's, ``selfplay.seat_trace``), then plays
    the match on with the policy in both seats (or the checkpoint opponent in the other; with
    partial rollouts the rows are the pool's, its matches' turns recorded as they end; with
    tree rollouts against it a row is a tree's leaf, its match the replayed opening, the
    leaf's first turn and the match played on after it); a
    step's value is the mean of its forks' rewards, the forked seat's, and a row's
    advantages differ from step to step (GRPO gives a row one). Here a move is the lowest
    free cell when the turn's text starts with an even character, else the highest
    (``text_parity_cell``)."""
    from rljax import algorithms
    from rljax.train.methods import tree_matches, vine
    k = 2
    extra = {"partial": {"rollout.engine": "slots", "rollout.partial": True,
                         "rollout.slots": 8},
             "demos": {"algo.mixed_policy": True, "algo.hint.threshold": 2.0,
                       "sft.trace_noise": 0.0},
             "hints": {"algo.hint.mode": "fixed", "algo.hint.fraction": 1.0,
                       "algo.hint.threshold": 2.0, "sft.trace_noise": 0.0},
             "checkpoint": {"env.selfplay.mode": "checkpoint",
                            "env.selfplay.workdir": request.getfixturevalue("rae_run")
                            if mode in ("checkpoint", "tree") else ""}}.get(mode, {})
    if mode == "tree":   # a group's 2 leaves share a root of one token
        extra = {**extra, "env.selfplay.mode": "checkpoint",
                 "env.selfplay.workdir": request.getfixturevalue("rae_run"),
                 "rollout.tree.enabled": True, "rollout.tree.roots": 1,
                 "rollout.tree.branching": 2, "rollout.tree.segment_tokens": 1}
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.adv_estimator": "vineppo",
                     "algo.vine.forks": k, "algo.vine.max_steps": 2, "steps": 1, **extra})
    seen, picked, trees, play_tree = [], vine.VineValues.picked, [], tree_matches.play_tree
    monkeypatch.setattr(vine.VineValues, "picked", lambda self, *a: (
        picked(self, *a), seen.append(self._last))[0])
    monkeypatch.setattr(tree_matches, "play_tree", lambda *a, **k: trees.append(
        play_tree(*a, **k)) or trees[-1])
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    (r,) = [r for r in read_metrics(workdir) if "reward/mean" in r]
    assert r["vine/prefixes"] > 0 and np.isfinite(r["loss"])
    v, tok = seen[0], setup.make_tokenizer(cfg, None)
    eps, later, demo_later = v["fork_episodes"], 0, 0
    if mode == "tree":   # the rows are leaves: a group's first turns share the root's token
        start = np.argmax(v["turn_ids"] == 0, axis=1)
        first = v["tokens"][np.arange(len(start)), start].reshape(-1, 2)
        assert (first[:, 0] == first[:, 1]).all() and trees
    assert len(v["hint_prefixes"]) == (len(v["tokens"]) if mode == "hints" else 0)
    # Demonstrations: each group's last row, its forks replaying the scripted match.
    assert np.sum(v.get("demo", 0)) == (len(v["tokens"]) // 2 if mode == "demos" else 0)
    assert v["fork_rewards"].shape == (len(v["fork_rows"]), k)
    for j, (i, t, start) in enumerate(v["fork_rows"]):
        for f in range(j * k, (j + 1) * k):   # the row's seat, its trajectory up to the fork
            assert eps["prompts"][f] == tok.decode(v["prompt_ids"][i])
            np.testing.assert_array_equal(eps["tokens"][f][:start], v["tokens"][i][:start])
        assert v["step_values"][i, t] == pytest.approx(v["fork_rewards"][j].mean())
        np.testing.assert_array_equal(v["fork_rewards"][j], eps["env_rewards"][j * k:(j + 1) * k])
        later += int(v["turn_ids"][i][start] > 0)
        demo_later += int(v["turn_ids"][i][start] > 0 and bool(v.get("demo", {i: 0})[i]))
    assert later, "no fork started after the other seat had moved"
    assert demo_later or mode != "demos", "no demonstration forked after its first turn"
    adv = np.asarray(algorithms.get_advantage_estimator("vineppo")(
        v["rewards"], 1, mask=v["step_ids"] >= 0, step_ids=v["step_ids"],
        step_values=v["step_values"], num_steps=v["num_steps"]))
    assert any(len(set(a[m].round(6).tolist())) > 1 for a, m in zip(adv, v["step_ids"] >= 0))
