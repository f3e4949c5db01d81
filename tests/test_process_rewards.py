"""PRM-shaped GRPO (algo.adv_estimator='grpo_process'): the process advantage against
DeepSeekMath's formula written out, the rollout stage's step rewards at each step's last token,
the config's one-line refusals, and a tiny run on a PRM run's checkpoint that resumes exactly."""
import types

import jax
import numpy as np
import pytest

from rljax import algorithms, models
from rljax import config as config_lib
from rljax.tokenizers import CharTokenizer
from rljax.train.methods import process_rewards, prm_scoring

TOK = CharTokenizer()


def written_out(step_rewards, step_ends, g, eps=1e-6):
    """DeepSeekMath 4.1.3 restated with loops: each group's step rewards normalised by their
    mean and (unbiased) std over the whole group, each token's advantage the sum of the
    normalised rewards of the steps that end at or after it. ``g``: the group size, or a list
    of consecutive groups' sizes."""
    n, t = step_ends.shape
    sizes = [g] * (n // g) if isinstance(g, int) else g
    out = np.zeros((n, t))
    for start, size in zip(np.cumsum([0] + sizes[:-1]), sizes):
        rows = range(start, start + size)
        r = [step_rewards[i, j] for i in rows for j in range(t) if step_ends[i, j]]
        if len(r) < 2 or max(r) == min(r):
            continue
        mean, std = np.mean(r), np.std(r, ddof=1)
        for i in rows:
            for s in range(t):
                out[i, s] = sum((step_rewards[i, j] - mean) / (std + eps)
                                for j in range(s, t) if step_ends[i, j])
    return out


def test_process_advantages_equal_the_written_out_formula():
    rng = np.random.default_rng(0)
    n, t, g = 12, 7, 4
    ends = rng.random((n, t)) < 0.35
    ends[8:12] = False
    ends[8, 3] = True              # group 3: one step in all -> no process term
    ends[4:8, 2] = True            # group 2: all its steps score the same -> 0
    rewards = rng.random((n, t)).astype(np.float32)
    rewards[4:8] = 0.25
    got = np.asarray(algorithms.process_advantages(rewards, ends, g))
    np.testing.assert_allclose(got, written_out(rewards, ends, g), rtol=1e-5, atol=1e-6)
    assert not got[4:12].any()

    outcome = rng.integers(0, 2, n).astype(np.float32)
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, n)[:, None]
    est = algorithms.get_advantage_estimator("grpo_process")
    assert algorithms.is_token_level("grpo_process")
    adv = np.asarray(est(outcome, g, mask=mask, step_rewards=rewards, step_ends=ends,
                         process_weight=0.5))
    grpo = np.asarray(algorithms.grpo_advantages(outcome, g))
    np.testing.assert_allclose(adv, np.where(mask, grpo[:, None] + 0.5 * got, 0.0),
                               rtol=1e-5, atol=1e-6)
    plain = est(outcome, g, mask=mask, step_rewards=rewards, step_ends=ends, process_weight=0.0)
    np.testing.assert_array_equal(np.asarray(plain), np.where(mask, grpo[:, None], 0.0))
    with pytest.raises(ValueError, match="gamma"):
        est(outcome, g, mask=mask, step_rewards=rewards, step_ends=ends, gamma=0.9)


def test_process_advantages_on_groups_of_their_own_sizes():
    """Knapsack allocation's ragged groups (``group_ids``): each group's statistics over its
    own rows, as the formula written out per group; with every group of G rows, the same as
    consecutive groups of G."""
    rng = np.random.default_rng(1)
    sizes, t = [3, 1, 5, 3], 6
    n = sum(sizes)
    ends = rng.random((n, t)) < 0.4
    ends[:, -1] = True
    rewards = rng.random((n, t)).astype(np.float32)
    rewards[4:9] = 0.5             # the group of 5: all its steps score the same -> 0
    ids = np.repeat(np.arange(len(sizes)), sizes) * 5 + 2     # any ids
    got = np.asarray(algorithms.process_advantages(rewards, ends, 0, group_ids=ids))
    np.testing.assert_allclose(got, written_out(rewards, ends, sizes), rtol=1e-5, atol=1e-6)
    assert not got[4:9].any() and got[3].any()   # a one-row group with steps is normalised

    outcome = rng.integers(0, 2, n).astype(np.float32)
    mask = ends.cumsum(1) <= ends.sum(1, keepdims=True)
    est = algorithms.get_advantage_estimator("grpo_process")
    assert algorithms.takes_group_ids("grpo_process")
    adv = np.asarray(est(outcome, 0, mask=mask, step_rewards=rewards, step_ends=ends,
                         process_weight=0.5, group_ids=ids))
    grpo = np.asarray(algorithms.grpo_advantages(outcome, 0, group_ids=ids))
    np.testing.assert_allclose(adv, np.where(mask, grpo[:, None] + 0.5 * got, 0.0),
                               rtol=1e-5, atol=1e-6)
    same = {"mask": mask, "step_rewards": rewards, "step_ends": ends}   # 3 groups of 4
    np.testing.assert_allclose(np.asarray(est(outcome, 0, group_ids=np.arange(n) // 4, **same)),
                               np.asarray(est(outcome, 4, **same)), rtol=1e-6, atol=1e-6)


def test_the_stage_puts_each_steps_score_on_its_last_token():
    """Steps end at the token that completes the delimiter, and the last step at the
    completion's end; the reward there is the sigmoid of the PRM's logit at that token."""
    cfg = config_lib.default_config()
    cfg.rollout.max_new_tokens = 14
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=TOK, stop_ids=(TOK.eos_id,),
                                model_cfg=models.get_preset("tiny"))
    stage = process_rewards.ProcessRewards(ctx)
    stage._scorer = prm_scoring.PRMScorer(ctx, rows=2)
    seen = {}

    def logits(batch):   # the logit at a token is its id / 10 - 3: known in advance
        seen["prompt"] = np.asarray(batch["prompt_tokens"])
        return np.asarray(batch["completion_tokens"], np.float32) / 10 - 3
    stage._scorer.logits = logits
    prompts, comps = ["3+4-2=", "1+1="], ["3+4=7\n7-2=5", "1+1=2"]
    n = 14
    comp_tok = np.full((2, n), TOK.pad_id, np.int32)
    comp_mask = np.zeros((2, n), bool)
    seqs = np.full((2, 8 + n), TOK.pad_id, np.int32)
    seq_mask = np.zeros((2, 8 + n), bool)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids, pid = TOK.encode(c) + [TOK.eos_id], TOK.encode(p)
        comp_tok[i, :len(ids)], comp_mask[i, :len(ids)] = ids, True
        seqs[i, 8 - len(pid):8], seq_mask[i, 8 - len(pid):8] = pid, True
        seqs[i, 8:], seq_mask[i, 8:] = comp_tok[i], comp_mask[i]
    groups = np.array([0, 1])   # a round source's groups of their own sizes stay
    rows = {"tokens": comp_tok, "mask": comp_mask, "estimator_inputs": {"group_ids": groups}}
    stage.finish_batch({"tokens": seqs, "mask": seq_mask}, rows)
    got = rows["estimator_inputs"]
    assert got["group_ids"] is groups
    want_ends = np.zeros((2, n), bool)
    want_ends[0, [5, 11]] = True      # "...7\n" ends step 1; the stop token ends step 2
    want_ends[1, 5] = True
    np.testing.assert_array_equal(got["step_ends"], want_ends)
    score = 1 / (1 + np.exp(-(comp_tok / 10 - 3)))
    np.testing.assert_allclose(got["step_rewards"], np.where(want_ends, score, 0.0), rtol=1e-6)
    assert TOK.decode(seen["prompt"][0][-6:].tolist()) == "3+4-2="
    assert stage.metrics([], rows)["process/steps_mean"] == 1.5
    # An episode: model turn 0, an observation, model turn 1. Steps are cut within the model's
    # turns (a turn's end ends a step; a delimiter inside an observation does not), and the
    # PRM reads the whole transcript, observations included.
    turns = [("a\nb", 0), ("=7\n", -1), ("c\nd", 1)]
    ids = [t for text, _ in turns for t in TOK.encode(text)]
    turn_ids = np.array([[k for text, k in turns for _ in TOK.encode(text)]
                         + [-1] * (n - len(ids))])
    ep_tok = np.full((1, n), TOK.pad_id, np.int32)
    ep_tok[0, :len(ids)] = ids
    ep_mask = np.arange(n)[None] < len(ids)
    pid = TOK.encode("1+1=")
    seqs = np.concatenate([np.full((1, 8), TOK.pad_id, np.int32), ep_tok], 1)
    seqs[0, 8 - len(pid):8] = pid
    seq_mask = np.concatenate([np.arange(8)[None] >= 8 - len(pid), ep_mask], 1)
    rows = {"tokens": ep_tok, "mask": ep_mask, "model_mask": turn_ids >= 0, "turn_ids": turn_ids}
    stage.finish_batch({"tokens": seqs, "mask": seq_mask}, rows)
    got = rows["estimator_inputs"]
    want_ends = np.zeros((1, n), bool)
    want_ends[0, [1, 2, 7, 8]] = True   # "a\n", turn 0's end "b"; "c\n", turn 1's end "d"
    np.testing.assert_array_equal(got["step_ends"], want_ends)
    assert not (got["step_ends"] & ~rows["model_mask"]).any()
    score = 1 / (1 + np.exp(-(ep_tok / 10 - 3)))
    np.testing.assert_allclose(got["step_rewards"], np.where(want_ends, score, 0.0), rtol=1e-6)
    assert TOK.decode(seen["prompt"][0][-4:].tolist()) == "1+1="


def _cfg(**extra):
    from test_prm import tiny_prm_cfg
    cfg = tiny_prm_cfg(2).copy_and_resolve_references()
    cfg.update_from_flattened_dict({
        "algo.name": "grpo", "algo.adv_estimator": "grpo_process", "algo.beta": 0.0,
        "algo.num_generations": 2, "rollout.batch_size": 4, "sft.steps": 0,
        "algo.process_reward.weight": 0.5, **extra})
    return config_lib.validate(cfg)


def test_config_refuses_what_grpo_process_cannot_read():
    with pytest.raises(config_lib.ConfigError, match="needs algo.process_reward.prm"):
        _cfg()
    with pytest.raises(config_lib.ConfigError, match="read only with"):
        _cfg(**{"algo.adv_estimator": "grpo", "algo.process_reward.prm": "runs/prm"})
    with pytest.raises(config_lib.ConfigError, match="algo.gamma"):
        _cfg(**{"algo.process_reward.prm": "runs/prm", "algo.gamma": 0.9})
    with pytest.raises(config_lib.ConfigError, match="data.step_delimiter"):
        _cfg(**{"algo.process_reward.prm": "runs/prm", "data.step_delimiter": ""})
    # A rollout stage: every sampler and mode takes it, and tool episodes.
    for mode in ({"rollout.engine": "slots"},
                 {"env.name": "tool", "env.tools": ("calculator",)},
                 {"rollout.engine": "slots", "rollout.partial": True},
                 {"algo.asynchronous": True}):
        _cfg(**{"algo.process_reward.prm": "runs/prm", **mode})


def test_a_prm_shaped_run_trains_on_a_prm_runs_scores_and_resumes_exactly(tmp_path):
    """A PRM run, then GRPO with its step scores: the scores are the PRM's (in (0, 1), every
    completion has a step), and a run stopped after one update and resumed equals a straight
    one (the PRM is reloaded from its run, the sampling keys come from the train state)."""
    from rljax.train import run
    from test_prm import _comparable, tiny_prm_cfg
    from test_train_loop import StopAfter

    devices = jax.devices()[:1]
    prm_dir = str(tmp_path / "prm")
    assert run.train(tiny_prm_cfg(1, **{"sft.steps": 0}), prm_dir, devices=devices) == 0
    straight, parts = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = _cfg(**{"algo.process_reward.prm": prm_dir})
    assert run.train(cfg, straight, devices=devices) == 0
    assert run.train(cfg, parts, devices=devices, stop=StopAfter(1)) == 0
    assert run.train(cfg, parts, devices=devices) == 0
    steps = [r for r in _comparable(straight) if "process/step_score_mean" in r]
    assert len(steps) == 2
    assert all(0 < r["process/step_score_mean"] < 1 and r["process/steps_mean"] >= 1
               for r in steps)
    assert _comparable(parts) == _comparable(straight)
    # Knapsack allocation: 3 samples over 2 prompts (one of them alone in its group, and a
    # padding row), each group's step scores normalised over its own rows.
    ragged = str(tmp_path / "knapsack")
    assert run.train(_cfg(**{"algo.process_reward.prm": prm_dir,
                             "rollout.allocation": "knapsack", "rollout.knapsack.budget": 3,
                             "rollout.knapsack.min_samples": 1,
                             "rollout.knapsack.max_samples": 2}), ragged, devices=devices) == 0
    steps = [r for r in _comparable(ragged) if "process/step_score_mean" in r]
    assert len(steps) == 2 and all(r["rollout/group_size_max"] == 2 and
                                   np.isfinite(r["loss"]) for r in steps)
    # Tool episodes: the PRM scores the steps of the model's turns on the whole transcript.
    episodes = str(tmp_path / "episodes")
    cfg = _cfg(**{"algo.process_reward.prm": prm_dir, "env.name": "tool",
                  "env.tools": ("calculator",), "env.tool_format": "plain",
                  "env.max_turns": 2, "env.max_total_tokens": 40, "env.max_obs_tokens": 8,
                  "steps": 1})
    cfg.env.kwargs = {"describe_tools": False}
    assert run.train(cfg, episodes, devices=devices) == 0
    steps = [r for r in _comparable(episodes) if "process/step_score_mean" in r]
    assert len(steps) == 1 and all(0 < r["process/step_score_mean"] < 1 and
                                   r["process/steps_mean"] >= 1 and "env/turns_mean" in r and
                                   np.isfinite(r["loss"]) for r in steps)


def test_the_plan_holds_the_prms_pass_at_the_stages_shape(tmp_path):
    """``rljax plan`` of a PRM-shaped GRPO run plans ``process/prm``: the PRM's pass over a
    micro-batch of rows at the longest prompt bucket, its weights an argument."""
    from rljax import plan as plan_lib
    from rljax.train.core import programs as programs_lib
    from rljax.train.core import workdir as wd
    from test_prm import tiny_prm_cfg

    wd.write_config(str(tmp_path), tiny_prm_cfg(1))   # a PRM run (its checkpoint is not read)
    cfg = _cfg(**{"algo.process_reward.prm": str(tmp_path), "algo.micro_batch_size": 2})
    ctx, _ = plan_lib.abstract_context(cfg, jax.devices()[:1])
    program = process_rewards.program(ctx)
    value, batch = program.args
    assert program.name == "process/prm" and program.resident == 0
    assert batch["prompt_tokens"].shape == (2, programs_lib.prompt_len(cfg))
    assert batch["completion_tokens"].shape == (2, cfg.rollout.max_new_tokens)
    assert set(value) == {"trunk", "head"}
    assert program.fn.lower(*program.args).compile().memory_analysis() is not None
    # Episodes: the PRM reads the whole trajectory after the prompt.
    cfg = _cfg(**{"algo.process_reward.prm": str(tmp_path), "algo.micro_batch_size": 2,
                  "env.name": "tool", "env.tools": ("calculator",), "env.max_total_tokens": 40})
    ctx, _ = plan_lib.abstract_context(cfg, jax.devices()[:1])
    assert process_rewards.program(ctx).args[1]["completion_tokens"].shape == (2, 40)
