"""Guidance for failed prompts (rljax.train.methods.guidance): hint prefixes are context only (no loss,
no gradient, no ratio), the adaptive fraction, the replay store, the ReLIFT buffer and its SFT
steps, exact resume with both on, and bad input."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import cli, models, rewards
from rljax import config as config_lib
from rljax.errors import ConfigError, UserError
from rljax.train import run
from rljax.train.core import checkpoint, setup, steps
from rljax.train.methods import guidance
from rljax.train.core.metrics import read_metrics
from rljax.train.phases import grpo
from rljax.train.phases.grpo import GRPOPhase
from rljax.train.core.state import create_train_state
from test_agent_train import watch_rows
from test_train_loop import StopAfter, comparable, final_params, tiny_cfg

DEVICES = jax.devices()[:1]


# ----------------------------------------------------------------------------- pure pieces

def test_prefix_length_rounds_and_respects_the_room_left():
    assert guidance.prefix_length(4, 0.5, room=10) == 2
    assert guidance.prefix_length(3, 0.5, room=10) == 2      # 1.5 rounds up
    assert guidance.prefix_length(3, 0.01, room=10) == 1     # a hint is at least one token
    assert guidance.prefix_length(3, 1.0, room=10) == 3
    assert guidance.prefix_length(5, 1.0, room=2) == 2       # the prompt bucket is full
    assert guidance.prefix_length(5, 0.5, room=0) == 0


def test_adaptive_fraction_moves_toward_the_target_success_rate():
    """With success rate = fraction (a policy that needs half the answer to succeed half the
    time), the per-prompt fraction settles at the target from either side."""
    for start in (0.05, 0.95):
        f = start
        for _ in range(60):
            f = guidance.adaptive_update(f, success_rate=f, target=0.5, step=0.25, low=0.0,
                                         high=1.0)
        assert abs(f - 0.5) < 1e-3, (start, f)
    # One update: failing hinted group -> more hint; all-succeeding -> less; clipped.
    assert guidance.adaptive_update(0.5, 0.0, 0.5, 0.25, 0.0, 1.0) == pytest.approx(0.625)
    assert guidance.adaptive_update(0.5, 1.0, 0.5, 0.25, 0.0, 1.0) == pytest.approx(0.375)
    assert guidance.adaptive_update(0.95, 0.0, 0.5, 0.25, 0.0, 0.9) == 0.9


def test_relift_buffer_entry_after_k_failed_visits_dedup_and_eviction():
    buf = guidance.ReliftBuffer(k_visits=2, size=2)
    a, b, c = ({"prompt": p, "answer": "1"} for p in "abc")
    buf.observe(a, solved=False)
    assert len(buf) == 0                      # one failed visit of two
    buf.observe(a, solved=True)               # a success resets the streak
    buf.observe(a, solved=False)
    assert len(buf) == 0
    buf.observe(a, solved=False)
    assert list(buf.entries.items) == ["a"]   # two failed visits in a row
    buf.observe(a, solved=False)
    assert len(buf) == 1                      # deduplicated
    for ex in (b, b, c, c):
        buf.observe(ex, solved=False)
    assert list(buf.entries.items) == ["b", "c"]  # FIFO bound 2: "a" (oldest) evicted
    state = json.loads(json.dumps(buf.state_dict()))
    again = guidance.ReliftBuffer(k_visits=2, size=2)
    again.load_state_dict(state)
    assert again.take(1) == [b] and list(again.entries.items) == ["c"]
    again.observe(b, solved=False)            # taken: its streak starts over
    assert list(again.entries.items) == ["c"]


def test_relift_control_buffers_prompts_whatever_their_outcome():
    failed = guidance.ReliftBuffer(k_visits=1, size=4)
    control = guidance.ReliftBuffer(k_visits=1, size=4, failed_only=False)
    for solved, p in ((True, "a"), (False, "b"), (True, "c")):
        failed.observe({"prompt": p}, solved=solved)
        control.observe({"prompt": p}, solved=solved)
    assert list(failed.entries.items) == ["b"]
    assert list(control.entries.items) == ["a", "b", "c"]


def test_bounded_dict_evicts_the_oldest():
    d = guidance.BoundedDict(2)
    for k in "abc":
        d.put(k, k.upper())
    assert d.state() == [["b", "B"], ["c", "C"]]
    d.put("b", "B2")                           # re-inserting makes it the newest
    d.put("d", "D")
    assert d.state() == [["b", "B2"], ["d", "D"]]


# ----------------------------------------------------------------------------- the Guide, no model

class FakeTokenizer:
    eos_id, pad_id = 0, 1

    def encode(self, text):
        return [ord(ch) for ch in text]


def hint_cfg(**kw):
    c = config_lib.default_config().algo.hint
    c.update(kw)
    return c


def make_guide(mode="fixed", source="replay", fallback=True, g=2):
    guide = guidance.Guide.__new__(guidance.Guide)
    guide.g, guide.threshold, guide.eos_id, guide.multiple = g, 1.0, 0, 1
    guide.solution = lambda ex: ex["answer"]
    guide.hints = guidance.Hints(hint_cfg(mode=mode, source=source, replay_fallback=fallback,
                                          fraction=0.5), guide.solution, FakeTokenizer(), 16)
    guide.buffer, guide.mixed = guidance.ReliftBuffer(1, 8), False
    return guide


def round_of(examples, rewards_, completions, g=2, n=6, prefixes=None):
    """A ``Rollout.sample_round``-shaped dict: completions are lists of ids (EOS appended)."""
    r = len(completions)
    tokens = np.full((r, n), 1, np.int32)
    mask = np.zeros((r, n), bool)
    for i, ids in enumerate(completions):
        ids = list(ids) + [0]
        tokens[i, :len(ids)], mask[i, :len(ids)] = ids, True
    prompt_ids = [[ord(c) for c in ex["prompt"]] + list(prefixes[i] if prefixes else [])
                  for i, ex in enumerate(examples)]
    rw = np.asarray(rewards_, np.float32)
    return {"examples": examples, "tokens": tokens, "mask": mask, "logps": -np.ones((r, n)),
            "lengths": mask.sum(1).astype(np.int32), "truncated": np.zeros(r, bool),
            "decoded": mask.sum(1).reshape(-1, g).sum(1),
            "rewards": rw, "scores": {"arithmetic": rw.copy()}, "prompt_ids": prompt_ids,
            "prompt_len": max(len(p) for p in prompt_ids), "errors": 0, "time_sample": 0.0,
            "time_reward": 0.0}


class FakeRollout:
    """Records the hinted re-sample request; every hinted sample succeeds."""

    def __init__(self, g=2):
        self.g, self.calls = g, []

    def sample_round(self, params, rng, examples, prefixes):
        self.calls.append((examples, prefixes))
        g = self.g
        return round_of(examples, [1.0] * (len(examples) * g),
                        [[ord("x")]] * (len(examples) * g), prefixes=prefixes)


# The round's key: the Guide folds in its own stream before it re-samples.
ROUND_KEY = jax.random.PRNGKey(0)


def test_replay_prefix_is_a_stored_success_of_the_same_prompt():
    guide, roll = make_guide(source="replay", fallback=False), FakeRollout()
    p, q = {"prompt": "p=", "answer": "1234"}, {"prompt": "q=", "answer": "5678"}
    # Visit 1: p has one success ("9876" in its second sample), q fails and has nothing
    # stored (no fallback): no hint for q.
    rnd = guide.after_round(roll, None, round_of([p, q], [0, 1, 0, 0],
                                                 [[50], [57, 56, 55, 54], [51], [52]]), ROUND_KEY)
    assert roll.calls == [] and rnd["hint"]["hinted"] == 0
    assert guide.hints.successes.get("p=") == [57, 56, 55, 54]
    # Visit 2: p fails: hinted with half of the stored success, not of the reference.
    rnd = guide.after_round(roll, None, round_of([p, q], [0, 0, 0, 0],
                                                 [[50], [50], [51], [52]]), ROUND_KEY)
    (examples, prefixes), = roll.calls
    assert examples == [p] and prefixes == [[57, 56]]
    # The hinted group replaced the failed one; the failed samples' tokens still count.
    assert rnd["prompt_ids"][0] == [ord("p"), ord("="), 57, 56]
    assert list(rnd["rewards"]) == [1, 1, 0, 0]
    assert rnd["extra_tokens"] == 4 and rnd["hint"]["hinted"] == 1
    assert rnd["hint"]["successes"] == 2 and rnd["hint"]["prefix_tokens"] == 2


def test_replay_falls_back_to_the_reference_and_adaptive_fractions_are_per_prompt():
    guide, roll = make_guide(mode="adaptive", source="replay", fallback=True), FakeRollout()
    p, q = {"prompt": "p=", "answer": "1234"}, {"prompt": "q=", "answer": "5678"}
    guide.after_round(roll, None, round_of([p, q], [0, 0, 0, 1],
                                           [[50], [50], [51], [52]]), ROUND_KEY)
    (examples, prefixes), = roll.calls
    assert examples == [p] and prefixes == [[ord("1"), ord("2")]]  # the reference's half
    # Every hinted sample succeeded (success 1 > target 0.5): p's fraction went down, q's
    # (never hinted) is still the starting one.
    assert guide.hints.fraction("p=") == pytest.approx(0.5 + 0.25 * (0.5 - 1.0))
    assert guide.hints.fraction("q=") == 0.5
    # The hinted success (prefix + continuation) is now p's stored success.
    assert guide.hints.successes.get("p=") == [ord("1"), ord("2"), ord("x")]


def test_hint_rows_are_bucketed():
    assert [guidance.hint_rows(16, h) for h in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert guidance.hint_rows(12, 9) == 12 and guidance.hint_rows(16, 3, multiple=8) == 8


# ----------------------------------------------------------------------------- with a model

def guided_cfg(**overrides):
    return tiny_cfg(**{"sft.steps": 0, "algo.beta": 0.0, "algo.mini_batch_size": 0,
                       "algo.hint.mode": "fixed", "algo.hint.fraction": 0.5, **overrides})


@pytest.fixture(scope="module")
def hinted_batch(tmp_path_factory):
    """One GRPO rollout of an untrained tiny model (its groups fail, so they are hinted), with
    every ``Rollout.sample_round`` call recorded by a spy."""
    cfg = guided_cfg()
    ctx = setup.build_context(cfg, str(tmp_path_factory.mktemp("ctx")), devices=DEVICES)
    phase = GRPOPhase(ctx, 2)
    state = create_train_state(ctx.params, phase.optimizer, jax.random.key(0))
    rollout, calls = phase.rollout, []
    original = rollout.sample_round

    def spy(params, rng, examples=None, prefixes=None):
        rnd = original(params, rng, examples=examples, prefixes=prefixes)
        calls.append((prefixes, {k: np.copy(rnd[k]) for k in ("lengths", "rewards", "tokens",
                                                               "mask")}, rnd))
        return rnd
    rollout.sample_round = spy
    batch, metrics = rollout(state, 0)
    return ctx, cfg, state, batch, metrics, calls


def test_hinted_groups_carry_the_prefix_as_prompt_context(hinted_batch):
    ctx, cfg, _, batch, metrics, calls = hinted_batch
    tok, g, n = ctx.tokenizer, cfg.algo.num_generations, cfg.rollout.max_new_tokens
    solution = guidance.solution_fn(ctx)
    assert [pre is None for pre, _, _ in calls] == [True, False]  # one round, one re-sample
    (_, main, _), (prefixes, hinted, rnd) = calls
    groups = cfg.rollout.batch_size // g
    k = round(metrics["hint/fraction_hinted"] * groups)
    assert k > 0 and metrics["hint/prefix_tokens_mean"] >= 1
    # Per-token arrays cover the completion slot only: nothing exists over the prefix that a
    # loss, ratio or KL could use.
    assert batch["loss_mask"].shape == batch["sampler_logps"].shape == (cfg.rollout.batch_size, n)
    p = batch["tokens"].shape[1] - n
    batch_prompts = [[int(t) for t, m in zip(batch["tokens"][r, :p], batch["mask"][r, :p]) if m]
                     for r in range(0, cfg.rollout.batch_size, g)]
    for j, ex in enumerate(rnd["examples"][:k]):
        ids = tok.encode(solution(ex))
        assert prefixes[j] == ids[:guidance.prefix_length(len(ids), 0.5, 99)]
        assert rnd["prompt_ids"][j] == tok.encode(ex["prompt"]) + prefixes[j]
        assert rnd["prompt_ids"][j] in batch_prompts   # the hinted group is in the batch
        # The reward judged prefix + continuation (the whole answer).
        rows = range(j * g, (j + 1) * g)
        texts = [tok.decode(prefixes[j] + list(hinted["tokens"][r][hinted["mask"][r]]))
                 for r in rows]
        want = rewards.get("arithmetic")([ex["prompt"]] * g, texts, answer=[ex["answer"]] * g)
        np.testing.assert_array_equal(hinted["rewards"][j * g:(j + 1) * g], want)
    # rollout/tokens: every sampled completion token, the replaced failed groups included,
    # the padding groups of the re-sample not.
    assert metrics["rollout/tokens"] == int(main["lengths"].sum()) + int(
        hinted["lengths"][:k * g].sum())
    # rollout/decoded_tokens: the first round's and the re-sample's real groups'.
    assert metrics["rollout/decoded_tokens"] == int(calls[0][2]["decoded"].sum()) + int(
        rnd["decoded"][:k].sum())


def test_prefix_positions_get_no_gradient_and_no_ratio(hinted_batch, monkeypatch):
    """The real GRPO loss on the hinted batch, with a perturbation ``delta`` added to every
    position's log-prob: the gradient w.r.t. delta is zero on the prompt (prefix included) and
    non-zero on trained completion tokens; perturbing the prefix positions changes nothing."""
    ctx, cfg, state, batch, _, _ = hinted_batch
    b, t = batch["tokens"].shape
    n = cfg.rollout.max_new_tokens
    rng = np.random.default_rng(0)
    mb = {k: jnp.asarray(v) for k, v in batch.items()}
    mb["advantages"] = jnp.asarray(rng.normal(size=b), jnp.float32)  # any non-zero signal
    mb["old_logps"] = mb["sampler_logps"] + 0.1
    real = models.token_logps

    def loss_of(delta):
        monkeypatch.setattr(models, "token_logps", lambda *a, **k: (
            lambda lp, ent: (lp + delta, ent))(*real(*a, **k)))
        (num, den), _ = grpo.grpo_loss(ctx.model_cfg, cfg.algo, 1.0, state.params, state, mb)
        return num / den

    grad = np.asarray(jax.grad(loss_of)(jnp.zeros((b, t), jnp.float32)))
    loss_of = jax.jit(loss_of)
    assert np.all(grad[:, :t - n] == 0)
    assert np.all(grad[:, t - n:][~batch["loss_mask"]] == 0)
    assert np.count_nonzero(grad[:, t - n:][batch["loss_mask"]]) > 0
    bump = np.zeros((b, t), np.float32)
    bump[:, :t - n] = rng.normal(size=(b, t - n))
    assert float(loss_of(jnp.asarray(bump))) == float(loss_of(jnp.zeros((b, t))))


# With tree sampling the demonstration replaces a failed tree's last leaf.
TREE = {"rollout.tree.enabled": True, "rollout.tree.segment_tokens": 1,
        "rollout.tree.branching": 2}


@pytest.mark.parametrize("tree", [False, True])
def test_mixed_policy_demo_rows_have_ratio_pi_theta_and_a_written_out_loss(tmp_path, tree):
    """``algo.mixed_policy``: the last sample of each failed group is the reference solution
    (reward 1, the only positive advantage of its group), its old log-probs are 0 (mu = 1),
    and the real GRPO loss equals the PPO-clip token-mean written out from a full forward
    pass with those old log-probs."""
    cfg = guided_cfg(**{"algo.hint.mode": "off", "algo.mixed_policy": True,
                        **(TREE if tree else {})})
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    phase = GRPOPhase(ctx, 2)
    state = create_train_state(ctx.params, phase.optimizer, jax.random.key(0))
    sampled, original = [], phase.rollout.sample_round
    phase.rollout.sample_round = lambda *a, **k: (lambda rnd: sampled.append(
        int(rnd["lengths"].sum())) or rnd)(original(*a, **k))
    batch, metrics = phase.rollout(state, 0)
    g, n = cfg.algo.num_generations, cfg.rollout.max_new_tokens
    demo_rows = [r for r in range(g - 1, cfg.rollout.batch_size, g)
                 if np.all(np.asarray(batch["old_logps"])[r] == 0)]
    assert metrics["mixed/demos"] == len(demo_rows) > 0
    tok, solution = ctx.tokenizer, guidance.solution_fn(ctx)
    p = batch["tokens"].shape[1] - n
    for r in demo_rows:
        prompt = tok.decode(batch["tokens"][r, :p][batch["mask"][r, :p]])
        ids = tok.encode(solution({"prompt": prompt, "answer": str(eval(prompt[:-1]))}))
        assert list(batch["tokens"][r, p:][batch["loss_mask"][r]]) == ids + [tok.eos_id]
        assert batch["advantages"][r] > 0 and np.all(batch["advantages"][r - g + 1:r] < 0)
    # The replaced sampled completions still count as sampled tokens.
    assert len(sampled) == 1 and metrics["rollout/tokens"] == sampled[0]
    # (A tree's shared segments are decoded once.)
    assert (metrics["rollout/decoded_tokens"] < sampled[0]) == tree
    mb = {k: jnp.asarray(v) for k, v in batch.items()}
    (num, den), _ = grpo.grpo_loss(ctx.model_cfg, cfg.algo, 1.0, state.params, state, mb)
    logps = np.asarray(models.token_logps(ctx.model_cfg, state.params, mb["tokens"],
                                          attention_mask=mb["mask"])[0])[:, -n:]
    ratio = np.exp(logps - np.asarray(batch["old_logps"]))
    adv = np.asarray(batch["advantages"])[:, None]
    eps = cfg.algo.epsilon
    pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    m = batch["loss_mask"]
    np.testing.assert_allclose(float(num / den), (pg * m).sum() / m.sum(), rtol=1e-5, atol=1e-6)
    assert np.all(ratio[demo_rows][m[demo_rows]] <= 1.0)  # bounded weight on demonstrations


# ----------------------------------------------------------------------------- training runs

RESUME = {"algo.hint.mode": "adaptive", "algo.hint.step": 0.5, "algo.hint.source": "replay",
          "algo.relift.every": 2, "algo.relift.batch_size": 4, "steps": 4}


def resume_cfg():
    cfg = guided_cfg(**RESUME)
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8, "num_examples": 8}  # prompts revisit
    return config_lib.validate(cfg)


@pytest.fixture(scope="module")
def guided_straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("guided"))
    assert run.train(resume_cfg(), workdir, devices=DEVICES) == 0
    return workdir


def test_relift_sft_step_every_n_steps_on_the_same_state(guided_straight):
    records = [r for r in read_metrics(guided_straight) if "reward/mean" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert ["relift/sft_loss" in r for r in records] == [False, True, False, True]
    assert all(r["relift/sft_rows"] > 0 and np.isfinite(r["relift/sft_loss"])
               for r in records if "relift/sft_loss" in r)
    assert all(r["hint/fraction_hinted"] > 0 for r in records)
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(guided_straight)) as ckpt:
        restored = ckpt.restore()
    # 4 RL updates and 2 SFT updates went through the same TrainState (its step counter).
    assert int(restored.state["step"]) == 4 + 2


def test_stop_and_resume_with_hints_and_relift_equals_straight_run(guided_straight, tmp_path):
    workdir = str(tmp_path)
    assert run.train(resume_cfg(), workdir, devices=DEVICES, stop=StopAfter(3)) == 0
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.latest_step() == 3
        state = ckpt.restore_meta()["phase_state"]["guidance"]
    assert state["hints"]["fractions"] and state["relift"]["entries"]  # non-trivial state
    assert run.train(resume_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(guided_straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir),
                 final_params(guided_straight))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("key, value, needle", [
    ("algo.hint.fraction", 1.5, "algo.hint.fraction=1.5 must be in [0.0, 1.0]"),
    ("algo.hint.target", -0.1, "algo.hint.target=-0.1 must be in [0.0, 1.0]"),
    ("algo.hint.max_fraction", 2.0, "algo.hint.max_fraction=2.0 must be in [0.0, 1.0]"),
    ("algo.hint.mode", "always", "algo.hint.mode='always' is not one of: off, fixed, adaptive"),
    ("algo.relift.k_visits", 0, "algo.relift.k_visits=0 must be >= 1"),
    ("algo.relift.prompts", "random", "algo.relift.prompts='random' is not one of: failed, any"),
])
def test_bad_ranges_name_the_key(key, value, needle):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({key: value})
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config_lib.validate(cfg)


def test_mixed_policy_and_hints_are_alternatives():
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"algo.mixed_policy": True, "algo.hint.mode": "fixed"})
    with pytest.raises(ConfigError, match="algo.mixed_policy=True and algo.hint.mode"):
        config_lib.validate(cfg)


def test_guidance_is_a_grpo_option():
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"algo.name": "dpo", "algo.relift.every": 2})
    with pytest.raises(ConfigError, match="algo.relift.every is an option of GRPO, PPO and distillation"):
        config_lib.validate(cfg)


def test_hints_on_data_without_solutions_exit_2_before_compiling(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    cfg = guided_cfg(**{"data.source": "jsonl", "data.path": str(data),
                        "algo.solution_field": "worked_solution"})
    cfg.data.kwargs = {}
    with pytest.raises(UserError, match="algo.hint.mode needs reference solutions: data: .*"
                                        "train.jsonl:1: the row needs one of the fields "
                                        r"\['worked_solution'\]"):
        setup.check_inputs(cfg, 1)
    config_file = tmp_path / "c.py"
    config_file.write_text(
        "import ml_collections\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
        f"    c.data = dict(source='jsonl', path={str(data)!r})\n"
        "    c.algo = dict(solution_field='worked_solution', hint=dict(mode='fixed'))\n"
        "    return c\n")
    assert cli.main(["train", "--config", str(config_file), "--workdir",
                     str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algo.hint.mode needs reference solutions" in err[0], err


@pytest.mark.parametrize("estimator", ["treepo", "rover"])
def test_a_demonstration_is_a_tree_of_its_own_for_the_tree_estimators(tmp_path, estimator):
    """Mixed-policy demonstrations with the tree estimators: the demonstration replacing a
    failed tree's last leaf shares no segment with the sampled leaves, so it enters the
    estimator as a one-leaf tree of its own (``sampling.tree.own_branches``): the batch's
    advantages are the estimator's over that layout, the demonstration's positive."""
    from rljax import algorithms
    from rljax.sampling import tree as tree_sampling
    cfg = guided_cfg(**{"algo.hint.mode": "off", "algo.mixed_policy": True, **TREE,
                        "algo.adv_estimator": estimator})
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    phase = GRPOPhase(ctx, 1)
    state = create_train_state(ctx.params, phase.optimizer, jax.random.key(0))
    seen = watch_rows(phase.rollout)
    batch, metrics = phase.rollout(state, 0)
    rows, g = seen.rows, cfg.algo.num_generations
    demo = np.asarray(rows["demo"], bool)
    assert metrics["mixed/demos"] == demo.sum() > 0
    layout = phase.rollout.tree_structure(len(demo) // g)
    node_ids = tree_sampling.own_branches(layout["node_ids"], demo)
    assert not (node_ids[demo][:, None, :] == node_ids[~demo][None, :, :]).any()
    estimate = algorithms.get_advantage_estimator(estimator)
    if estimator == "treepo":
        want = estimate(rows["rewards"], g, node_ids=node_ids)
        assert np.all(np.asarray(batch["advantages"])[demo] > 0)
    else:
        want = estimate(rows["rewards"], g, node_ids=node_ids, mask=batch["loss_mask"],
                        token_kl=np.zeros(batch["loss_mask"].shape, np.float32),
                        segments=layout["segments"], kl_coef=0.0, gamma=1.0)
        assert np.all(np.asarray(batch["advantages"])[demo].sum(-1) > 0)
    np.testing.assert_allclose(batch["advantages"], want, rtol=1e-5, atol=1e-6)
    phase.iteration(state, 0)   # and it trains
