"""A run with images in the prompt (the ``tiny-vlm`` preset on the ``shapes`` task): SFT and
GRPO batches carry each prompt's pixels, the sampler reads them (static, slot engine, partial
rollouts, asynchronously, multi-turn episodes), and a stopped and resumed run equals a
straight one."""
import json

import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.config import ConfigError
from rljax.data.tasks import TASKS
from rljax.envs import register_env
from rljax.train import run
from rljax.train.core import checkpoint, episodes
from rljax.train.core.metrics import read_metrics
from rljax.train.core.rollout import Rollout

from test_train_loop import StopAfter, comparable, final_params
from tests.test_agent_train import EchoEnv

DEVICES = jax.devices()[:1]
SFT_STEPS, RL_STEPS = 1, 2


def vlm_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": RL_STEPS, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny-vlm", "model.vision.image_token": "@", "tokenizer.kind": "char",
        "data.source": "shapes", "data.max_prompt_length": 48, "rollout.batch_size": 8,
        "rollout.max_new_tokens": 2, "rollout.temperature": 1.0, "algo.num_generations": 4,
        "algo.beta": 0.0, "optimizer.learning_rate": 1e-3, "sft.steps": SFT_STEPS,
        "sft.learning_rate": 1e-3, "sft.batch_size": 4, "sft.max_length": 52,
        "eval.num_examples": 4, "eval.batch_size": 4, "logging.tensorboard": False,
        "checkpoint.async_save": False, "reward.names": ("arithmetic",),
    })
    cfg.model.overrides = {"num_layers": 1}
    cfg.data.kwargs = {"kinds": "count,locate", "eval_examples": 4}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    seen = []
    original = Rollout._assemble

    def assemble(self, rounds, groups):
        batch, rows = original(self, rounds, groups)
        seen.append(batch.get("pixels"))
        return batch, rows

    Rollout._assemble = assemble
    try:
        workdir = str(tmp_path_factory.mktemp("straight"))
        assert run.train(vlm_cfg(), workdir, devices=DEVICES) == 0
    finally:
        Rollout._assemble = original
    return workdir, seen


def test_the_rl_batch_carries_each_prompts_pixels(straight):
    workdir, seen = straight
    assert len(seen) == RL_STEPS
    pixels = seen[0]
    assert pixels is not None and pixels.shape == (8, 1, 3, 32, 32)
    # G rows per prompt share its image; different prompts have different images.
    np.testing.assert_array_equal(pixels[0], pixels[3])
    assert not np.array_equal(pixels[0], pixels[4])
    params = final_params(workdir)
    assert "vision" in params
    rl = [r for r in read_metrics(workdir) if "reward/mean" in r]
    assert rl[0]["rollout/logp_diff_max"] < 1e-4   # sampler and trainer saw the same images


def test_vision_tower_stays_frozen_by_default(straight):
    """Full fine-tuning without model.vision.train: the tower after the SFT step is the tower
    at the end (no gradient, no weight decay)."""
    workdir, _ = straight
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        first = jax.tree.map(np.asarray, ckpt.restore(SFT_STEPS).state["params"]["vision"])
    last = final_params(workdir)["vision"]
    jax.tree.map(np.testing.assert_array_equal, first, last)


def test_the_ppo_critic_values_the_images():
    """PPO's critic reads a row's images through its copy of the tower: other pixels, other
    values of the completion's states, equal to a trunk pass given the embeddings."""
    from rljax import models
    from rljax.models import vision
    from rljax.train.phases.ppo import completion_values
    from test_vision_sharding import _batch, _model

    cfg, params = _model()
    critic = models.init_value_params(cfg, jax.random.PRNGKey(2), from_params=params)
    batch = _batch()
    other = dict(batch, pixels=batch["pixels"][::-1].copy())
    values = np.asarray(completion_values(cfg, critic, batch))
    assert values.shape == batch["loss_mask"].shape
    assert not np.allclose(values, np.asarray(completion_values(cfg, critic, other)))
    embeds = vision.image_embeddings(cfg, critic["trunk"], batch["pixels"])
    full = models.value_forward(cfg, critic, batch["tokens"], attention_mask=batch["mask"],
                                image_embeds=embeds)
    np.testing.assert_allclose(values, np.asarray(full)[:, -5:-1], rtol=1e-6)


def test_stop_and_resume_with_images_equals_straight_run(straight, tmp_path):
    workdir = str(tmp_path)
    stop_at = SFT_STEPS + 1
    assert run.train(vlm_cfg(), workdir, devices=DEVICES, stop=StopAfter(stop_at)) == 0
    assert max(r["step"] for r in read_metrics(workdir)) == stop_at
    assert run.train(vlm_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(straight[0]))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir),
                 final_params(straight[0]))


def test_shapes_task_examples_are_deterministic_and_split():
    task = TASKS["shapes"](kinds="count,compare,locate", seed=3)
    a, b = task.example(5), task.example(5)
    assert a["question"] == b["question"] and np.array_equal(a["images"], b["images"])
    assert a["question"].startswith("@@@@\n") and a["images"].shape == (32, 32, 3)
    assert {task.example(i)["kind"] for i in range(30)} == {"count", "compare", "locate"}
    train = {(e["question"], e["images"].tobytes()) for e in map(task.example, range(200))}
    held = {(e["question"], e["images"].tobytes())
            for e in (task.example(i, "eval") for i in range(50))}
    assert not train & held


def test_export_writes_the_whole_vlm(straight, tmp_path):
    """``rljax export`` of the run: text model, tower and projector, read back equal."""
    from rljax.models.hf_vision import load_hf_vlm
    out = tmp_path / "export"
    assert run.export(vlm_cfg(), straight[0], str(out), devices=DEVICES) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"]
    _, vcfg, params = load_hf_vlm(str(out))
    assert vcfg.num_layers == 2
    jax.tree.map(np.testing.assert_array_equal, params, final_params(straight[0]))


def test_the_slot_engine_samples_with_the_images(tmp_path):
    """GRPO on the slot engine with images: the engine prefills each prompt's images into its
    page; the run trains, reports the engine's utilisation and evaluates (also on the engine)."""
    cfg = vlm_cfg(**{"rollout.engine": "slots", "rollout.slots": 4, "sft.steps": 0})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    records = read_metrics(str(tmp_path))
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == RL_STEPS and all(0 < r["rollout/slot_utilisation"] <= 1 for r in rl)
    assert any("eval/accuracy" in r for r in records)


def test_asynchronous_rl_with_images_resumes_exactly(tmp_path):
    """algo.asynchronous on the slot engine with images: the batches in flight keep their
    pixels through a checkpoint; stopped and resumed, equal to the straight run."""
    cfg = vlm_cfg(**{"algo.asynchronous": True, "rollout.engine": "slots", "rollout.slots": 4,
                     "sft.steps": 0, "steps": 3, "algo.entropy_coef": 0.01})
    straight_dir, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight_dir, devices=DEVICES) == 0
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    rl = [r for r in read_metrics(straight_dir) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1]
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight_dir))
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                 final_params(straight_dir))


def test_partial_rollouts_with_images_train_and_resume_exactly(tmp_path, monkeypatch):
    """rollout.partial with images: the pool prefills each group's images with its prompt and
    with the caches it rebuilds for carried samples (their tokens drawn under the new weights
    score as the trainer scores them), and the groups in flight at the checkpoint get their
    pixels decoded again from their examples: resumed equals straight."""
    seen, call = [], Rollout.__call__

    def record(self, state, step):   # each batch: its tokens' versions, the trainer's logps
        batch, metrics = call(self, state, step)
        seen.append(dict(versions=self.rounds._taken.rows["versions"],
                         old_logps=np.asarray(self.logps_fn(state.params, batch)),
                         sampler=batch["sampler_logps"], loss_mask=batch["loss_mask"]))
        return batch, metrics
    monkeypatch.setattr(Rollout, "__call__", record)
    # 2 slots, 3 decode steps a chunk, 2 per sample: the run stops with samples mid-decode;
    # 2 layers: a rebuilt cache's keys and values depend on the prompt (and its images)
    cfg = vlm_cfg(**{"rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 2,
                     "rollout.chunk_steps": 3, "rollout.max_new_tokens": 3, "sft.steps": 0,
                     "algo.entropy_coef": 0.01, "model.overrides.num_layers": 2})
    straight_dir, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight_dir, devices=DEVICES) == 0
    last = seen[1]
    fresh = (last["versions"] == 1) & last["loss_mask"]
    carried = (last["versions"] == 0).any(1) & fresh.any(1)
    assert carried.any()   # samples begun under version 0, continued under version 1
    np.testing.assert_allclose(last["sampler"][fresh], last["old_logps"][fresh], atol=1e-4)
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    rl = [r for r in read_metrics(straight_dir) if "reward/mean" in r]
    assert len(rl) == RL_STEPS and rl[0]["rollout/carried_groups"] == 2
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight_dir))
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                 final_params(straight_dir))


TREE = {"rollout.tree.enabled": True, "rollout.tree.roots": 2, "rollout.tree.branching": 2,
        "rollout.tree.segment_tokens": 1, "sft.steps": 0, "steps": 1}


@pytest.mark.parametrize("overrides", [
    {}, {"rollout.engine": "slots", "rollout.slots": 8},
    {"rollout.engine": "slots", "rollout.slots": 8, "rollout.partial": True}],
    ids=["static", "slots", "partial"])
def test_trees_are_sampled_with_the_images(tmp_path, overrides):
    """Tree rollouts with images (the static tree sampler, the slot engine's, the partial
    pool's): every path's requests are prefilled with its prompt's images, so the sampler's
    log-probs of the leaves are the trainer's (which reads the pixels)."""
    assert run.train(vlm_cfg(**TREE, **overrides), str(tmp_path), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 1 and rl[0]["rollout/logp_diff_max"] < 1e-4


class LookAgainEnv(EchoEnv):
    """The example's prompt (its images' tokens included) as the first user message; answers
    the first two turns with an observation, ends after the third: every episode has three
    model turns after the images."""

    TURNS, ROLE = 3, "user"

    def answer(self, text: str) -> str:
        return "look"


register_env("look_again", LookAgainEnv)


class LookLongerEnv(LookAgainEnv):
    """``LookAgainEnv`` whose observation's length (1 to 6 characters) is set by the turn's
    text: episodes of different lengths, so some are carried between their turns."""

    def answer(self, text: str) -> str:
        return "l" * (1 + sum(map(ord, text)) % 6)


register_env("look_longer", LookLongerEnv)
EPISODES = {"env.name": "look_again", "env.max_turns": 3, "env.max_turn_tokens": 2,
            "env.max_obs_tokens": 8, "env.max_total_tokens": 24, "sft.steps": 0, "steps": 1}


@pytest.mark.parametrize("overrides", [{}, {"rollout.engine": "slots", "rollout.slots": 3},
                                       {"algo.name": "ppo", "algo.adv_estimator": "gae"},
                                       {"algo.asynchronous": True, "rollout.engine": "slots",
                                        "rollout.slots": 3, "steps": 2}],
                         ids=["static", "slots", "ppo", "async"])
def test_episodes_see_the_images_in_every_turn(tmp_path, monkeypatch, overrides):
    """Multi-turn episodes with images (static turn batches, the episode engine): each group's
    prompt is prefilled with its images once and every later turn attends to those keys and
    values, so the sampler's log-probs of all three turns are the trainer's, whose row (prompt
    ++ trajectory) carries the prompt's pixels (PPO's critic reads them too)."""
    seen, original = [], Rollout._assemble

    def assemble(self, rounds, groups):
        batch, rows = original(self, rounds, groups)
        seen.append(batch)
        return batch, rows
    monkeypatch.setattr(Rollout, "_assemble", assemble)
    embeds, play = [], episodes.run_episodes

    def run_episodes(*args, image_embeds=None, **kw):   # training's and held-out episodes
        embeds.append(image_embeds)
        return play(*args, image_embeds=image_embeds, **kw)
    monkeypatch.setattr(episodes, "run_episodes", run_episodes)
    cfg = vlm_cfg(**{**EPISODES, **overrides, "eval_every": 1})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    assert len(embeds) >= 2 and all(e is not None for e in embeds)
    pixels = seen[0]["pixels"]
    assert pixels.shape == (8, 1, 3, 32, 32) and np.abs(pixels).sum() > 0
    np.testing.assert_array_equal(pixels[0], pixels[3])   # a group shares its prompt's images
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == cfg.steps and rl[0]["env/turns_mean"] == 3
    assert rl[0]["rollout/logp_diff_max"] < 1e-4   # every turn saw the images


def test_partial_episodes_carry_their_images_and_resume_exactly(tmp_path, monkeypatch):
    """rollout.partial with episodes and images: each place keeps its example's pixels, the
    engine prefills them every iteration, so the turns a carried episode plays under the new
    weights (after its trajectory is fed again) score as the trainer scores them with the
    batch's pixels; on resume the places' pixels are decoded again from their examples."""
    seen, call = [], Rollout.__call__

    def record(self, state, step):   # each batch: its model tokens' versions, both logps
        batch, metrics = call(self, state, step)
        model = batch["model_mask"]
        versions = np.full(model.shape, -1)
        versions[model] = np.concatenate([d["versions"] for d in self.rounds._drawn])
        seen.append(dict(versions=versions, pixels=batch["pixels"], model=model,
                         old_logps=np.asarray(self.logps_fn(state.params, batch)),
                         sampler=batch["sampler_logps"]))
        return batch, metrics
    monkeypatch.setattr(Rollout, "__call__", record)
    # 3 slots for 4 groups of 4 episodes of different lengths: the round completes with later
    # groups mid-episode;
    # 2 layers: a fed-again trajectory's keys and values depend on the prompt's images
    cfg = vlm_cfg(**{**EPISODES, "env.name": "look_longer", "steps": 2,
                     "rollout.engine": "slots", "rollout.slots": 3,
                     "rollout.partial": True, "rollout.chunk_steps": 2,
                     "algo.entropy_coef": 0.01, "model.overrides.num_layers": 2})
    straight_dir, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight_dir, devices=DEVICES) == 0
    first, last = seen[:2]
    assert first["pixels"].shape == (8, 1, 3, 32, 32) and np.abs(first["pixels"]).sum() > 0
    now = last["versions"].max()   # this iteration's version
    fresh = last["versions"] == now
    carried = ((last["versions"] >= 0) & (last["versions"] < now)).any(1) & fresh.any(1)
    assert carried.any()   # episodes begun under the last version, continued under this one
    for b, tokens in ((first, first["model"]), (last, fresh)):
        np.testing.assert_allclose(b["sampler"][tokens], b["old_logps"][tokens], atol=1e-4)
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    rl = [r for r in read_metrics(straight_dir) if "reward/mean" in r]
    assert len(rl) == 2 and rl[0]["rollout/carried_groups"] == 2
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight_dir))
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                 final_params(straight_dir))


KNAPSACK = {"rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 2,
            "rollout.knapsack.max_samples": 4, "sft.steps": 0, "steps": 1}


PARTIAL = {"rollout.engine": "slots", "rollout.slots": 3, "rollout.partial": True}


@pytest.mark.parametrize("overrides", [{}, PARTIAL, EPISODES, {**EPISODES, **PARTIAL}],
                         ids=["prompts", "partial", "episodes", "partial_episodes"])
def test_knapsack_groups_carry_their_images(tmp_path, monkeypatch, overrides):
    """Groups of the knapsack's sizes with images (single-turn and episodes, carried across
    iterations or not): each prompt is prefilled with its images and every row of its group
    carries its pixels, so the sampler's log-probs are the trainer's."""
    seen, call = [], Rollout.__call__

    def record(self, state, step):
        batch, metrics = call(self, state, step)
        seen.append(batch)
        return batch, metrics
    monkeypatch.setattr(Rollout, "__call__", record)
    assert run.train(vlm_cfg(**{**overrides, **KNAPSACK}), str(tmp_path), devices=DEVICES) == 0
    pixels = seen[0]["pixels"]
    assert pixels.shape == (8, 1, 3, 32, 32) and np.abs(pixels).sum() > 0
    assert not np.array_equal(pixels[0], pixels[-1])   # two prompts' rows
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 1 and rl[0]["rollout/group_size_mean"] == 4
    assert rl[0]["rollout/logp_diff_max"] < 1e-4   # every row sampled with its images


VINE = {"algo.adv_estimator": "vineppo", "algo.vine.forks": 2, "algo.vine.max_steps": 2,
        "sft.steps": 0, "steps": 1}


def assert_drawn_with_images(model_cfg, params, prompts, tokens, mask, logps, pixels):
    """The tokens a sampler drew (``mask``, log-prob recorded: not fed) after ``prompts``
    (token ids per row) score as the model scores them with each row's ``pixels``."""
    import jax.numpy as jnp
    from rljax import models, sampling
    from rljax.models import vision
    p_tok, p_mask = sampling.pad_to_bucket([list(p) for p in prompts], pad_id=0)
    full, full_mask = np.concatenate([p_tok, tokens], 1), np.concatenate([p_mask, mask], 1)
    embeds = vision.image_embeddings(model_cfg, params, jnp.asarray(pixels))
    scored, _ = models.token_logps(model_cfg, params, jnp.asarray(full), jnp.asarray(full_mask),
                                   first_scored=p_tok.shape[1], image_embeds=embeds)
    # (a drawn image token is scored as one, docs/vision.md "Not yet": rows without one)
    clean = ~((tokens == model_cfg.image_token_id) & mask).any(1, keepdims=True)
    drawn = np.asarray(mask, bool) & (logps != 0) & clean
    assert drawn.sum() > 4
    np.testing.assert_allclose(np.asarray(scored)[:, p_tok.shape[1]:][drawn], logps[drawn],
                               atol=1e-4)
    return True


@pytest.mark.parametrize("overrides", [{}, EPISODES], ids=["prompts", "episodes"])
def test_vineppo_forks_see_the_images(tmp_path, monkeypatch, overrides):
    """VinePPO with images (single-turn, episodes): each fork prefills its valued row's
    prompt images (an episode's page, under which its turns are replayed, too), so the
    tokens the forks draw score as the model scores them with those images."""
    from rljax.train.methods import vine
    forks, drawn, step_values, generate = [], [], vine.VineValues.step_values, vine.generate

    def spy_generate(ctx, params, p_tok, p_mask, rng, **kw):   # single-turn forks
        out = generate(ctx, params, p_tok, p_mask, rng, **kw)
        drawn.append((p_tok, p_mask.astype(bool), out))
        return out

    def spy_values(self, params, rnd, rng):   # checked now: the update frees the params
        drawn.clear()
        out = step_values(self, params, rnd, rng)
        rows = [i for i, *_ in out["fork_rows"] for _ in range(self.k)]   # K per fork
        if "fork_episodes" in out:
            eps = out["fork_episodes"]
            fields = [eps["prompt_ids"], eps["tokens"], eps["mask"], eps["logps"]]
        else:
            (p_tok, p_mask, o), = drawn
            prefixes = [t[m] for t, m in zip(p_tok, p_mask) for _ in range(self.k)]
            fields = [prefixes[:len(rows)]] + [o[key][:len(rows)]
                                               for key in ("tokens", "mask", "logps")]
        forks.append(assert_drawn_with_images(self.ctx.model_cfg, params, *fields,
                                              rnd["pixels"][rows]))
        return out
    monkeypatch.setattr(vine.VineValues, "step_values", spy_values)
    monkeypatch.setattr(vine, "generate", spy_generate)
    assert run.train(vlm_cfg(**{**overrides, **VINE}), str(tmp_path), devices=DEVICES) == 0
    assert forks == [True]
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 1 and rl[0]["vine/fork_tokens"] > 0 and np.isfinite(rl[0]["loss"])


def test_the_warm_ups_scripted_episodes_carry_the_images(tmp_path, monkeypatch):
    """sft.env_traces with images: the tool environment's scripted episodes of JSONL rows
    whose prompt holds an image (a picture and a sum for the calculator) train with each
    row's pixels; then GRPO plays the environment's episodes with them."""
    from PIL import Image
    from rljax.train.phases.sft import SFTPhase
    rng, rows = np.random.default_rng(0), []
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), np.uint8)).save(tmp_path / f"{i}.png")
        rows.append({"question": f"{i}+1=", "answer": str(i + 1), "images": f"{i}.png"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen, make_batch = [], SFTPhase.make_batch

    def record(self, examples, step=0):
        batch = make_batch(self, examples, step)
        image_id, = self.ctx.tokenizer.encode("@")
        seen.append((batch, self.images.pixels(examples), (batch["tokens"] == image_id).sum(1)))
        return batch
    monkeypatch.setattr(SFTPhase, "make_batch", record)
    cfg = vlm_cfg(**{"data.source": "jsonl", "data.path": str(data), "data.eval_path": str(data),
                     "data.template": "@@@@\n{question}", "env.name": "tool",
                     "env.max_turns": 2, "env.max_turn_tokens": 4, "env.max_total_tokens": 24,
                     "sft.env_traces": True, "sft.max_length": 80, "steps": 1})
    cfg.data.kwargs = {}
    cfg.env.kwargs = {"describe_tools": False}   # (a prompt of the image and the sum only)
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    (batch, pixels, image_tokens), = seen
    assert (image_tokens == 4).all()   # every scripted episode's prompt holds its image
    assert batch["pixels"].shape == (4, 1, 3, 32, 32) and np.abs(pixels).sum() > 0
    np.testing.assert_array_equal(batch["pixels"], pixels)   # each row its example's
    records = read_metrics(str(tmp_path / "run"))
    assert np.isfinite([r["loss"] for r in records if "loss" in r]).all()
    assert any("reward/mean" in r for r in records)


def test_relift_sft_rows_carry_the_images(tmp_path, monkeypatch):
    """ReLIFT's SFT step on the prompts that keep failing: each row carries its example's
    pixels (the padding rows the first example's), as the warm-up's rows do."""
    from rljax.train.methods.relift import Relift
    seen, batch_of = [], Relift.batch

    def record(self, examples):
        batch, cut = batch_of(self, examples)
        rows = list(examples) + [examples[0]] * (len(batch["tokens"]) - len(examples))
        seen.append((batch, self.images.pixels(rows)))
        return batch, cut
    monkeypatch.setattr(Relift, "batch", record)
    cfg = vlm_cfg(**{"algo.relift.every": 1, "algo.relift.k_visits": 1,
                     "algo.relift.batch_size": 4, "sft.steps": 0, "steps": 1})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    (batch, pixels), = seen
    assert batch["pixels"].shape == (4, 1, 3, 32, 32) and np.abs(pixels).sum() > 0
    np.testing.assert_array_equal(batch["pixels"], pixels)
    (r,) = [r for r in read_metrics(str(tmp_path)) if "relift/sft_loss" in r]
    assert r["relift/sft_rows"] > 0 and np.isfinite(r["relift/sft_loss"])


@pytest.mark.parametrize("key,overrides", [("rollout.tree.enabled", TREE)])
def test_episodes_that_would_drop_images_are_refused(key, overrides):
    with pytest.raises(ConfigError, match=rf"^{key}=.*env.name='look_again' with images"):
        vlm_cfg(**{**EPISODES, **overrides})
