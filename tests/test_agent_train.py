"""Training on multi-turn episodes (env.name set): the loop end to end (SFT on scripted tool
episodes, GRPO on the model's own episodes, agentic eval, env metrics), exact resume, the
loss seeing model tokens only, and config errors before anything compiles."""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import cli
from rljax.envs import StepResult, register_env
from rljax import config as config_lib
from rljax.train import run
from rljax.train.core import checkpoint, setup
from rljax.train.methods.agent import EpisodeRounds
from rljax.train.methods.episode_credit import credit_stages
from rljax.train.core.rollout import Rollout, RolloutStage
from rljax.train.core.state import create_train_state
from rljax.train.core.metrics import read_metrics
from rljax.train.phases.grpo import grpo_loss
from tests.test_train_loop import StopAfter, comparable, final_params

DEVICES = jax.devices()[:1]
SFT_STEPS, RL_STEPS = 2, 3
# The main run's guidance: hints continue a failed group's first turn, ReLIFT trains on the
# scripted episodes of prompts that keep failing (the Guide's state is carried on resume);
# its temperature schedule runs over each episode's model tokens, across its turns.
GUIDED = {"rollout.temperature_schedule.name": "linear",
          "rollout.temperature_schedule.start": 1.5, "rollout.temperature_schedule.end": 0.5,
          "rollout.temperature_schedule.tokens": 30,
          "algo.hint.mode": "adaptive", "algo.hint.step": 0.5, "algo.hint.source": "replay",
          "algo.relift.every": 1, "algo.relift.k_visits": 1, "algo.relift.batch_size": 2,
          "data.kwargs.num_examples": 2,   # every step revisits both prompts
          "data.max_prompt_length": 32}    # room for the hint after the prompt


def agent_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": RL_STEPS, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 28,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "sft.steps": SFT_STEPS, "sft.learning_rate": 1e-3, "sft.batch_size": 8,
        "sft.max_length": 64, "sft.env_traces": True, "eval.num_examples": 4,
        "eval.batch_size": 4, "logging.tensorboard": False, "checkpoint.async_save": False,
        "env.name": "tool", "env.tools": ("calculator",), "env.tool_format": "plain",
        "env.max_turns": 2, "env.max_total_tokens": 56, "env.max_obs_tokens": 20,
    })
    cfg.env.kwargs = {"describe_tools": False}
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "ops": "*", "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


class SeenRows(RolloutStage):
    """Keeps the rows of the last batch a rollout assembled (rewards, roles, turns, ...)."""

    name = "seen_rows"
    rows = None

    def finish_batch(self, batch, rows):
        self.rows = rows


def watch_rows(rollout) -> SeenRows:
    """A ``SeenRows`` stage added to ``rollout``."""
    seen = SeenRows()
    rollout.stages.append(seen)
    return seen


def episode_rollout(ctx, iterator, cfg=None):
    """The GRPO rollout over episodes as the phase builds it: a plain ``Rollout`` with the
    episodes as its round source and the credit stages of ``cfg`` (default ``ctx.cfg``)."""
    return Rollout(ctx, iterator, rounds=EpisodeRounds(ctx),
                   stages=credit_stages(cfg if cfg is not None else ctx.cfg))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("agent_straight"))
    assert run.train(agent_cfg(**GUIDED), workdir, devices=DEVICES) == 0
    return workdir


def test_loop_logs_env_metrics_and_agentic_eval(straight):
    records = read_metrics(straight)
    rl = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in rl] == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))
    for key in ("env/turns_mean", "env/tool_calls_mean", "env/truncated_frac",
                "env/model_tokens_mean", "time/env", "loss", "entropy"):
        assert key in rl[0], key
    # Same params, same math: the trainer's log-probs of model tokens are the sampler's, each
    # at the temperature its position in the episode drew it at.
    assert rl[0]["rollout/logp_diff_max"] < 1e-4
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [SFT_STEPS, SFT_STEPS + RL_STEPS]
    assert "eval/turns_mean" in evals[0] and evals[0]["eval/num_examples"] == 4
    assert [r["step"] for r in records if "sft/loss" in r] == [1, 2]
    # The untrained policy fails: its groups are hinted, and ReLIFT's SFT steps ran.
    assert all(r["hint/fraction_hinted"] > 0 and r["hint/prefix_tokens_mean"] >= 1 for r in rl)
    assert all(r["relift/sft_rows"] > 0 and np.isfinite(r["relift/sft_loss"]) for r in rl)


def test_env_metrics_count_the_hinted_episodes_that_train(tmp_path):
    """Hints replace a failed group's episodes with hinted ones; ``env/*`` describes the
    episodes that train, as ``reward/mean`` does: their model tokens and turns, not those of
    the failed episodes they replaced."""
    from rljax.train.phases import grpo
    ctx = setup.build_context(agent_cfg(**GUIDED), str(tmp_path), devices=DEVICES)
    phase = grpo.GRPOPhase(ctx, RL_STEPS)
    seen = watch_rows(phase.rollout)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    _, m = phase.rollout(state, 0)
    assert m["hint/fraction_hinted"] > 0   # the untrained policy fails: groups are hinted
    rows = seen.rows
    assert m["env/model_tokens_mean"] == pytest.approx(rows["model_mask"].sum(1).mean())
    assert m["env/turns_mean"] == pytest.approx(rows["turns"].mean())


def test_stop_and_resume_equals_straight_run(straight, tmp_path):
    workdir = str(tmp_path)
    assert run.train(agent_cfg(**GUIDED), workdir, devices=DEVICES,
                     stop=StopAfter(SFT_STEPS + 1)) == 0
    assert max(r["step"] for r in read_metrics(workdir)) == SFT_STEPS + 1
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        guide = ckpt.restore_meta()["phase_state"]["guidance"]
    assert guide["hints"]["fractions"] and guide["relift"] is not None   # state to carry
    assert run.train(agent_cfg(**GUIDED), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(straight))


def _episode_fields(records):
    """What the sampled episodes decide: rewards, turns, lengths, tool calls."""
    keys = ("reward/mean", "env/turns_mean", "env/model_tokens_mean", "env/tool_calls_mean",
            "completion/length_mean")
    return [{k: r[k] for k in keys if k in r} for r in records if "reward/mean" in r]


def test_episodes_on_the_slot_engine_train_as_the_static_batches(straight, tmp_path):
    """rollout.engine='slots' (3 slots for 8 episodes, 4-step chunks): the same episodes as the
    static turn batches (each row draws its own noise), so the same rewards and updates."""
    workdir = str(tmp_path)
    cfg = agent_cfg(**GUIDED, **{"rollout.engine": "slots", "rollout.slots": 3,
                                 "rollout.chunk_steps": 4})
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    records, ref = read_metrics(workdir), read_metrics(straight)
    assert _episode_fields(records) == _episode_fields(ref)
    assert all(0 < r["rollout/slot_utilisation"] <= 1 for r in records if "reward/mean" in r)
    for a, b in zip(final_params(workdir)["layers"].values(),
                    final_params(straight)["layers"].values()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_asynchronous_episodes_on_the_engine_resume_exactly(tmp_path):
    """algo.asynchronous with episodes on the slot engine: batches sampled a version ahead
    (episodes in flight are saved with the checkpoint); stopped and resumed, equal to the
    straight run."""
    cfg = agent_cfg(**{"algo.asynchronous": True, "rollout.engine": "slots",
                       "rollout.slots": 4, "algo.entropy_coef": 0.01})
    straight_dir, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight_dir, devices=DEVICES) == 0
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(SFT_STEPS + 1)) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    records = read_metrics(straight_dir)
    assert [r["rollout/sample_version"] for r in records if "reward/mean" in r] == [0, 0, 1]
    assert comparable(read_metrics(resumed)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                 final_params(straight_dir))


class EchoEnv:
    """Answers every first turn with ``<r>LEN</r>`` (so every episode has observation
    tokens, whatever an untrained model writes); done after the second turn (``TURNS``),
    its observations in a ``ROLE`` message."""

    TURNS, ROLE = 2, "tool"

    def __init__(self, example):
        self.example, self.turns = example, 0

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns >= self.TURNS:
            return StepResult(done=True)
        return StepResult(observation=[{"role": self.ROLE, "content": self.answer(text)}])

    def answer(self, text: str) -> str:
        return f"<r>{len(text)}</r>"


register_env("test_echo", EchoEnv)


def assert_hinted_episodes_continue_their_prefix(ctx, rollout, state):
    """Hinted episodes (``guidance``): the prefix ends the prompt (context, not trajectory),
    and the environment judged prefix + sampled first turn (EchoEnv answers its length)."""
    tok, g = ctx.tokenizer, rollout.g
    examples = [{"prompt": "1*2="}, {"prompt": "3*3="}]
    prefixes = [tok.encode("ab"), tok.encode("wxyz")]
    rnd = rollout.sample_round(state.params, jax.random.key(3), examples, prefixes)
    for row in range(len(examples) * g):
        prefix = prefixes[row // g]
        assert rnd["prompt_ids"][row // g][-len(prefix):] == prefix
        first = rnd["tokens"][row][rnd["turn_ids"][row] == 0].tolist()
        seen = len(tok.decode(prefix + first))
        assert f"<r>{seen}</r>" in rnd["episodes"]["transcripts"][row]


def test_loss_ignores_observation_tokens(tmp_path):
    """A real episode batch: ``loss_mask`` is exactly the model's tokens, and changing every
    per-token input of the loss (old/sampler/reference log-probs, token advantages) at the
    observation positions changes neither the loss nor its gradient; the same change at a
    model token does (so the test can fail)."""
    cfg = agent_cfg(**{"algo.beta": 0.04, "algo.tis_cap": 2.0, "algo.adv_estimator":
                       "reinforce_pp_baseline", "sft.steps": 0, "sft.env_traces": False,
                       "env.name": "test_echo", "env.tools": (),
                       "rollout.max_new_tokens": 8,
                       "rollout.temperature_schedule.name": "linear",
                       "rollout.temperature_schedule.start": 2.0,
                       "rollout.temperature_schedule.end": 0.5})
    cfg.env.kwargs = {}
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    rollout = episode_rollout(ctx, setup.data_iterator(ctx, 2))
    import optax
    state = create_train_state(ctx.params, optax.sgd(0.1), jax.random.key(0),
                               ref_params=jax.tree.map(lambda x: x * 1.01, ctx.params))
    batch, _ = rollout(state, 0)
    n = batch["loss_mask"].shape[1]
    seq_obs = batch["mask"][:, -n:] & ~batch["model_mask"]
    assert seq_obs.sum() > 0, "the batch should have observation tokens"
    np.testing.assert_array_equal(batch["loss_mask"], batch["model_mask"])
    assert batch["advantages"].shape == (8, n)   # token-level: per position
    # Under the temperature schedule an episode's k-th model token, whatever its turn, was
    # drawn at schedule[k]: the trainer's log-probs at those temperatures are the sampler's.
    m = batch["model_mask"]
    assert np.abs(np.asarray(batch["old_logps"]) - batch["sampler_logps"])[m].max() < 1e-4

    @jax.jit
    def value_and_grad(params, b):
        def loss(params):
            num, den = grpo_loss(ctx.model_cfg, cfg.algo, 1.0, params, state, b)[0]
            return num / den
        return jax.value_and_grad(loss)(params)

    def loss_and_grad(b):
        value, grad = value_and_grad(state.params, {k: jnp.asarray(v) for k, v in b.items()})
        return float(value), grad

    def perturbed(where):
        b = dict(batch)
        rs = np.random.default_rng(0)
        for key in ("old_logps", "sampler_logps", "ref_logps", "advantages"):
            x = np.array(b[key])
            x[where] = rs.normal(size=int(where.sum())) * 3
            b[key] = jnp.asarray(x)
        return b

    base_loss, base_grad = loss_and_grad(batch)
    assert_hinted_episodes_continue_their_prefix(ctx, rollout, state)
    loss, grad = loss_and_grad(perturbed(seq_obs))
    assert loss == base_loss
    jax.tree.map(np.testing.assert_array_equal, grad, base_grad)
    one_model_token = np.zeros_like(seq_obs)
    one_model_token[np.argwhere(batch["model_mask"])[0][0], np.argwhere(
        batch["model_mask"])[0][1]] = True
    assert loss_and_grad(perturbed(one_model_token))[0] != base_loss


@pytest.mark.parametrize("override,needle", [
    ("--config.env.name=nope", "env.name: unknown environment 'nope'"),
    ("--config.env.tools=('calculator','abacus')", "env.tools: unknown tool 'abacus'"),
    ("--config.env.max_turns=0", "env.max_turns=0 must be >= 1"),
    ("--config.env.tool_format=json", "env.tool_format='json'"),
    ("--config.algo.name=dpo", "multi-turn episodes train with algo.name='grpo', 'ppo', "
                               "'distill' or online 'dpo'"),
])
def test_bad_env_config_is_one_line_exit_2(tmp_path, override, needle):
    assert_one_line_config_error(tmp_path, "return agent_cfg()", override, needle)


@pytest.mark.parametrize("key, value", [("algo.relift.every", 1), ("algo.mixed_policy", True)])
def test_guidance_trains_on_scripted_episodes_only_where_the_env_has_them(key, value):
    with pytest.raises(config_lib.ConfigError, match=re.escape(
            f"{key} trains on the environment's scripted episodes: env.name='test_echo' has "
            "none")):
        agent_cfg(**{"sft.env_traces": False, "env.name": "test_echo", "env.tools": (),
                     key: value})


def test_a_demonstration_episode_is_the_scripted_one_scored_as_if_sampled():
    """Mixed-policy demonstrations of episodes (host only): the failed group's last row
    becomes the example's scripted episode, its model turns trained (observations context),
    its reward the replayed environment's plus the answer's score, mu = 1 (logps 0)."""
    from types import SimpleNamespace
    from rljax import rewards
    from rljax.train.methods.demos import insert_episode_demos
    cfg = agent_cfg(**{"algo.mixed_policy": True})
    tok = setup.make_tokenizer(cfg, None)
    ex = {"prompt": "5*8=", "question": "5*8=", "answer": "40"}
    m, r = cfg.env.max_total_tokens, 2
    rnd = {"tokens": np.zeros((r, m), np.int32), "mask": np.ones((r, m), bool),
           "model_mask": np.ones((r, m), bool), "turn_ids": np.zeros((r, m), np.int32),
           "logps": np.full((r, m), -1.0, np.float32), "lengths": np.full(r, m),
           "truncated": np.ones(r, bool), "turns": np.ones(r, np.int32),
           "turn_rewards": np.zeros((r, cfg.env.max_turns), np.float32),
           "rewards": np.zeros(r, np.float32),
           "scores": {"env": np.zeros(r, np.float32), "arithmetic": np.zeros(r, np.float32)}}
    rollout = SimpleNamespace(cfg=cfg, ctx=SimpleNamespace(tokenizer=tok),
                              reward_fn=rewards.combine([("arithmetic", 1.0, {})]))
    prompt = tok.encode(ex["prompt"])
    rnd = insert_episode_demos(rollout, rnd, [ex], [1], [prompt])
    assert rnd["demo"].tolist() == [False, True] and rnd["logps"][1].max() == 0.0
    n = rnd["lengths"][1]
    text = tok.decode(rnd["tokens"][1, :n].tolist())
    model = tok.decode(rnd["tokens"][1][rnd["model_mask"][1]].tolist())
    assert text.startswith("<call calculator>5*8</call>") and "<result>40</result>" in text
    assert model == "<call calculator>5*8</call>40" and not rnd["truncated"][1]
    assert rnd["turn_ids"][1][rnd["model_mask"][1]].tolist()[-1] == 1
    assert rnd["turns"][1] == 2 and rnd["rewards"][1] == 1.0
    assert rnd["turn_rewards"][1].tolist() == [0.0, 1.0]
    assert rnd["rewards"][0] == 0.0 and rnd["model_mask"][0].all()   # other rows untouched
    # A group whose prompt is not the demonstration's keeps its sample.
    assert not insert_episode_demos(rollout, rnd, [ex], [0], [prompt[:-1]])["demo"].any()


def assert_one_line_config_error(tmp_path, body: str, override: str, needle: str) -> None:
    """``rljax train`` on a config file whose ``get_config`` is ``body`` (one line, with
    ``agent_cfg`` in scope) plus ``override``: exit 2, one stderr line holding ``needle``,
    nothing written."""
    path = tmp_path / "agent.py"
    path.write_text("from tests.test_agent_train import agent_cfg\n"
                    f"def get_config():\n    {body}\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["train", "--config", str(path), "--workdir", str(tmp_path / "w"),
                         override])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("rljax: error:"), lines
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_chat_template_tool_format_needs_a_tokenizer_template(monkeypatch, tmp_path):
    """``json`` with ``tokenizer.chat_template`` but a tokenizer without a template: one line
    naming the key when the tokenizer is loaded, before the model is built."""
    from rljax import tokenizers
    monkeypatch.setattr(tokenizers.CharTokenizer, "has_chat_template", property(lambda s: False))
    cfg = agent_cfg(**{"env.tool_format": "json", "tokenizer.chat_template": True})
    with pytest.raises(config_lib.ConfigError, match="tokenizer.chat_template"):
        setup.make_tokenizer(cfg, None)


def test_sample_prints_whole_episodes(straight, capsys):
    """``rljax sample`` on a run with an environment plays episodes and prints transcripts."""
    assert run.sample(agent_cfg(), straight, ["3*4=", "7*8="], devices=DEVICES) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt ---") == 2 and out.count("--- episode (") == 2
    assert "3*4=" in out and "turns, environment reward" in out


def test_games_count_solved_episodes_as_correct_and_report_turns_to_solve():
    """A game solved on its 3rd guess under a turn penalty (reward 0.9) is correct; turns to
    solve average the solved episodes only (the unsolved one played 10 turns)."""
    from rljax.train.methods.agent import env_metrics, episode_correct
    counters = [{"solved": 1, "guesses": 3}, {"solved": 0, "guesses": 10}, {"solved": 1,
                                                                            "guesses": 5}]
    ok = episode_correct(np.array([0.9, 0.0, 0.8], np.float32), counters)
    assert ok.tolist() == [True, False, True]
    assert episode_correct(np.array([1.0, 0.5]), [{}, {}]).tolist() == [True, False]
    eps = {"turns": np.array([3, 10, 5]), "truncated": np.array([False, True, False]),
           "model_tokens": np.array([6, 20, 10]), "counters": counters}
    m = env_metrics([eps], prefix="eval")
    assert m["eval/turns_mean"] == 6.0 and m["eval/solved_turns_mean"] == 4.0
    assert m["eval/solved_mean"] == pytest.approx(2 / 3)
    assert "env/solved_turns_mean" not in env_metrics([dict(eps, counters=[{}] * 3)])
