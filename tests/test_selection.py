"""Prompt selection (``data.selection``, rljax/data/selection.py): the pure pieces against
written-out arithmetic, each selector's behaviour, the rollout's band filter, exact resume with
each method on, and bad input."""
import json
import os

import jax
import numpy as np
import pytest

from rljax import cli
from rljax import config as config_lib
from rljax import data as data_lib
from rljax.data import selection
from rljax.errors import ConfigError
from rljax.train import inference, run
from rljax.train.core import setup
from rljax.train.core.metrics import read_metrics
from rljax.train.phases import make_phases

from test_train_loop import StopAfter, comparable

DEVICES = jax.devices()[:1]
RL_STEPS = 4


# ----------------------------------------------------------------------------- pure pieces

def test_group_successes_threshold_and_fractional():
    rewards = np.array([1, 0, 1, 1, 0.5, 0.5, -1, 2], np.float32)  # two groups of 4
    np.testing.assert_array_equal(selection.group_successes(rewards, 4), [3, 1])
    np.testing.assert_array_equal(selection.group_successes(rewards, 4, threshold=0.5), [3, 3])
    np.testing.assert_allclose(selection.group_successes(rewards, 4, fractional=True),
                               [3.0, 0.5 + 0.5 + 0 + 1])


def test_band_keeps_exactly_the_closed_band():
    rates = np.array([0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0])
    np.testing.assert_array_equal(selection.in_band(rates, 0.25, 0.75),
                                  [False, False, True, True, True, False, False])
    # DAPO's dynamic sampling as a band: G = 8, (0, 1) exclusive == [1/8, 7/8].
    np.testing.assert_array_equal(selection.in_band(rates, 0.125, 0.875),
                                  [False, True, True, True, True, True, False])


def test_beta_update_against_written_out_arithmetic():
    # a' = 0.9 * 2 + 0.1 * 1 + 5 = 6.9 ; b' = 0.9 * 3 + 0.1 * 1 + (8 - 5) = 5.8
    a, b = selection.beta_update(2.0, 3.0, 5.0, 8.0, decay=0.9, prior_a=1.0, prior_b=1.0)
    assert a == pytest.approx(6.9, abs=1e-12) and b == pytest.approx(5.8, abs=1e-12)
    # No decay: the conjugate Beta-Bernoulli update.
    assert selection.beta_update(2.0, 3.0, 1.0, 4.0, decay=1.0, prior_a=7.0,
                                 prior_b=7.0) == (3.0, 6.0)
    # Full decay: back to the prior plus this evidence only.
    assert selection.beta_update(50.0, 9.0, 2.0, 4.0, decay=1e-300, prior_a=1.0,
                                 prior_b=2.0) == pytest.approx((3.0, 4.0))


def test_thompson_choice_concentrates_near_the_target():
    # 30 candidates whose posteriors are sharp around 0.05, 0.5 and 0.95 (10 each).
    means = np.repeat([0.05, 0.5, 0.95], 10)
    a, b = means * 2000, (1 - means) * 2000
    for seed in range(5):
        picked, rates = selection.thompson_pick(a, b, 10, 0.5, np.random.default_rng(seed))
        assert sorted(picked.tolist()) == list(range(10, 20))
        assert np.abs(rates[picked] - 0.5).max() < 0.05
    # Target 0.95 picks the easy ones; flat posteriors (Beta(1, 1)) pick at random.
    picked, _ = selection.thompson_pick(a, b, 10, 0.95, np.random.default_rng(0))
    assert sorted(picked.tolist()) == list(range(20, 30))
    flat = [set(selection.thompson_pick(np.ones(30), np.ones(30), 10, 0.5,
                                        np.random.default_rng(s))[0].tolist()) for s in range(3)]
    assert flat[0] != flat[1] != flat[2]


def test_next_level_moves_with_accuracy_and_stays_in_range():
    assert selection.next_level(2, 0.95, 0.3, 0.8, 1, 3) == 3      # too easy: harder
    assert selection.next_level(3, 0.95, 0.3, 0.8, 1, 3) == 3      # at the top
    assert selection.next_level(2, 0.10, 0.3, 0.8, 1, 3) == 1      # too hard: easier
    assert selection.next_level(1, 0.10, 0.3, 0.8, 1, 3) == 1      # at the bottom
    assert selection.next_level(2, 0.50, 0.3, 0.8, 1, 3) == 2      # in the band: stay


# ----------------------------------------------------------------------------- selectors

def _iterator(batch_size=4, num_examples=12, digits=3):
    cfg = {"source": "arithmetic", "digits": digits, "operands": 2, "ops": "+",
           "num_examples": num_examples, "template": "{question}"}
    return data_lib.make_iterator(cfg, batch_size=batch_size, seed=0)


def _options(name, **kw):
    options = config_lib.default_config().data.selection.to_dict()
    options.update(name=name, **kw)
    return options


def test_uniform_is_the_iterator_itself():
    it = _iterator()
    assert selection.make(it, _options("uniform")) is it
    reference = _iterator()
    for _ in range(5):  # recording the indices changes nothing that is drawn
        batch = next(it)
        assert batch == next(reference)
        assert [it.source[i]["question"] for i in it.last_indices] == [
            ex["question"] for ex in batch]


def test_predicted_updates_the_posteriors_of_the_prompts_it_picked():
    sel = selection.make(_iterator(), _options("predicted", pool_factor=3, decay=0.5,
                                               prior_a=1.0, prior_b=3.0))
    batch = next(sel)
    assert len(batch) == 4 and len(set(sel.last_indices)) == 4
    rewards = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0], np.float32)  # G = 4
    sel.observe(rewards, 4)
    for index, s in zip(sel.last_indices, [4, 1, 0, 2]):
        # a' = 0.5 * 1 + 0.5 * 1 + s ; b' = 0.5 * 3 + 0.5 * 3 + (4 - s)
        assert sel.posteriors[index] == (1.0 + s, 3.0 + 4 - s)
    # A prompt seen again is updated from its posterior, not the prior.
    first = sel.last_indices[0]
    sel.last_indices = [first]
    sel.observe(np.zeros(4, np.float32), 4)
    assert sel.posteriors[first] == selection.beta_update(5.0, 3.0, 0.0, 4.0, decay=0.5,
                                                          prior_a=1.0, prior_b=3.0)
    # Bounded memory: the least recently updated go first.
    small = selection.make(_iterator(), _options("predicted", max_tracked=2, pool_factor=1))
    next(small)
    small.observe(np.zeros(16, np.float32), 4)
    assert list(small.posteriors) == small.last_indices[2:]


def test_predicted_prefers_prompts_predicted_near_the_target():
    sel = selection.make(_iterator(num_examples=12), _options("predicted", pool_factor=3,
                                                              target=0.5, decay=1.0))
    # Evidence: indices 0-5 always solved, 6-11 solved half the time.
    for i in range(12):
        sel.posteriors[i] = (200.0, 1.0) if i < 6 else (100.0, 100.0)
    for _ in range(4):
        next(sel)
        assert all(i >= 6 for i in sel.last_indices)


def test_curriculum_raises_and_lowers_the_knob_with_training_accuracy():
    sel = selection.make(_iterator(batch_size=8, num_examples=64, digits=3),
                         _options("curriculum", knob="digits", min_level=1, window=2,
                                  low=0.3, high=0.8))
    digits = lambda batch: max(len(n) for ex in batch for n in ex["question"][:-1].split("+"))  # noqa: E731
    assert sel.level == 1 and digits(next(sel)) == 1
    solved, failed = np.ones(32, np.float32), np.zeros(32, np.float32)
    sel.observe(solved, 4)
    assert sel.level == 1                      # decides every `window` rounds
    sel.observe(solved, 4)
    assert sel.level == 2 and digits(next(sel)) == 2
    for _ in range(4):
        sel.observe(solved, 4)
    assert sel.level == 3                      # the configured difficulty is the top
    sel.observe(failed, 4)
    sel.observe(np.r_[np.ones(8), np.zeros(24)].astype(np.float32), 4)   # mean 0.125 < 0.3
    assert sel.level == 2
    sel.observe(np.r_[np.ones(16), np.zeros(16)].astype(np.float32), 4)
    sel.observe(np.r_[np.ones(16), np.zeros(16)].astype(np.float32), 4)  # 0.5: in the band
    assert sel.level == 2


def test_selector_state_round_trips_through_json():
    for name, kw in [("predicted", {}), ("curriculum", {"window": 3}),
                     ("online_filter", {})]:
        a = selection.make(_iterator(), _options(name, **kw))
        for _ in range(3):
            next(a)
            a.observe(np.linspace(0, 1, 16).astype(np.float32) > 0.4, 4)
            a.keep_groups(np.ones(16, np.float32), 4)
        b = selection.make(_iterator(), _options(name, **kw))
        b.restore(json.loads(json.dumps(a.state())))
        assert b.state() == a.state()
        assert next(b) == next(a)


# ----------------------------------------------------------------------------- in a run

REWARD = '''
def even_length(prompts, completions, **_):
    """Varied pass rates from an untrained model: 1 for an even-length completion."""
    return [float(len(c) % 2 == 0) for c in completions]
'''

SELECTIONS = {
    "online_filter": {"data.selection.low": 0.5, "data.selection.high": 0.5,
                      "algo.max_sampling_rounds": 2},
    "predicted": {"data.selection.pool_factor": 2, "data.selection.decay": 0.8},
    "curriculum": {"data.selection.window": 1, "data.selection.low": 0.0,
                   "data.selection.high": 0.3, "data.selection.knob": "digits"},
}


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    return str(path)


def tiny_cfg(reward_file, name, **overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": RL_STEPS, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "sft.steps": 0, "eval.num_examples": 8, "eval.batch_size": 8,
        "logging.tensorboard": False, "checkpoint.async_save": False,
        "data.selection.name": name, "data.selection.threshold": 1.0,
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 3, "eval_examples": 8, "num_examples": 12}
    cfg.reward.names = (f"{reward_file}:even_length",)
    cfg.update_from_flattened_dict({**SELECTIONS.get(name, {}), **overrides})
    return config_lib.validate(cfg)


def test_online_filter_trains_exactly_the_in_band_groups(reward_file, tmp_path):
    cfg = tiny_cfg(reward_file, "online_filter")
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    phase = make_phases(ctx)[-1]
    rounds, seen_more = [], False
    original = phase.rollout.sample_round
    phase.rollout.sample_round = lambda *a: rounds.append(original(*a)) or rounds[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    for step in range(3):
        rounds.clear()
        batch, metrics = phase.rollout(state, step)
        g, want = 4, 4
        in_band = [(r, i) for r, rnd in enumerate(rounds)
                   for i, ok in enumerate(selection.in_band(
                       selection.group_successes(rnd["rewards"], g) / g, 0.5, 0.5)) if ok]
        kept = in_band[:want]
        assert metrics["rollout/rounds"] == len(rounds) and metrics["rollout/filler_groups"] \
            == want - len(kept)
        trains = batch["loss_mask"].reshape(want, g, -1).any(axis=(1, 2))
        assert trains.tolist() == [True] * len(kept) + [False] * (want - len(kept))
        n = batch["loss_mask"].shape[1]
        for j, (r, i) in enumerate(kept):  # the kept groups, in order, are the batch's rows
            np.testing.assert_array_equal(batch["tokens"][j * g:(j + 1) * g, -n:],
                                          rounds[r]["tokens"][i * g:(i + 1) * g])
        # Every sampled token counts, of the rounds whose groups were dropped too.
        assert metrics["rollout/tokens"] == sum(int(r["lengths"].sum()) for r in rounds)
        if len(rounds) > 1:
            seen_more = True
    assert seen_more, "the band never made the rollout sample a second round"


@pytest.mark.parametrize("name", ["online_filter", "predicted", "curriculum"])
def test_exact_resume_with_selection(reward_file, tmp_path, name):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(tiny_cfg(reward_file, name), straight, devices=DEVICES) == 0
    assert run.train(tiny_cfg(reward_file, name), resumed, devices=DEVICES,
                     stop=StopAfter(RL_STEPS // 2)) == 0
    assert max(r["step"] for r in read_metrics(resumed)) == RL_STEPS // 2
    assert run.train(tiny_cfg(reward_file, name), resumed, devices=DEVICES) == 0
    records = read_metrics(straight)
    assert comparable(read_metrics(resumed)) == comparable(records)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == RL_STEPS and all(k.startswith("selection/") for k in rl[0]
                                       if k.startswith("selection/"))
    if name == "curriculum":  # each step's level follows from its accuracy (window 1)
        level = 1
        for r in rl:
            level = selection.next_level(level, r["selection/accuracy"], 0.0, 0.3, 1, 3)
            assert r["selection/level"] == level
        assert level > 1
    if name == "predicted":
        assert rl[-1]["selection/tracked"] > 4  # prompts seen; some seen more than once
    if name == "online_filter":
        assert any(r["rollout/rounds"] > 1 for r in rl)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, key", [
    (["data.selection.name=thompson"], "data.selection.name"),
    (["data.selection.name=online_filter", "data.selection.low=-0.1"], "data.selection.low"),
    (["data.selection.name=online_filter", "data.selection.high=1.5"], "data.selection.high"),
    (["data.selection.name=online_filter", "data.selection.low=0.8",
      "data.selection.high=0.2"], "data.selection.low"),
    (["data.selection.name=predicted", "data.selection.target=2"], "data.selection.target"),
    (["data.selection.name=curriculum", "data.source=jsonl", "data.path=x.jsonl"],
     "data.selection.name"),
    (["data.selection.name=curriculum", "data.selection.knob=max_number"],
     "data.selection.knob"),
    (["data.selection.name=curriculum", "data.selection.min_level=0"],
     "data.selection.min_level"),
    (["data.selection.name=online_filter", "algo.dynamic_sampling=true"],
     "data.selection.name"),
    (["data.selection.name=predicted", "algo.name=dpo"], "data.selection.name"),
])
def test_bad_selection_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_lib.load_config(None, overrides)


def test_bad_selection_is_one_line_exit_2_before_compiling(tmp_path, capsys):
    workdir = tmp_path / "run"
    code = cli.main(["train", "--config", "configs/grpo_arithmetic.py", "--workdir",
                     str(workdir), "--config.data.selection.name=curriculum",
                     "--config.data.source=jsonl", "--config.data.path=x.jsonl"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "difficulty knob" in err, err
    assert not os.path.exists(workdir / "checkpoints")
