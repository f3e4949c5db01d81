"""On-policy distillation: the per-token reverse-KL advantage and GKD's generalised JSD against
formulas written out in NumPy (values and gradients), the update exact under micro-batching,
the teacher read from an rljax workdir (latest or chosen step), the same-tokenizer refusal
before anything is built, and a stopped-and-resumed run equal to a straight one."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms, tokenizers
from rljax import config as config_lib
from rljax.errors import ConfigError, UserError
from rljax.train import run
from rljax.train.core import checkpoint, inputs
from rljax.train.core import teacher as teacher_lib
from rljax.train.core.metrics import read_metrics
from rljax.train.phases import grpo

from test_train_loop import (DEVICES, StopAfter, comparable, final_params, resumes_exactly,
                             tiny_cfg)
from test_train_steps import MODEL, algo_cfg, fresh_state, make_batch, scanned_grpo_step

# ----------------------------------------------------------------------------- formulas


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_jsd(student_logps, teacher_logps, beta):
    """GKD's generalised JSD over a token subset, written out in float64."""
    q = np.exp(_log_softmax(np.asarray(student_logps, np.float64)))
    p = np.exp(_log_softmax(np.asarray(teacher_logps, np.float64)))

    def kl(a, b):
        return (a * (np.log(a) - np.log(b))).sum(-1)

    if beta == 0:
        return kl(p, q)
    if beta == 1:
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_values_and_gradient_match_numpy(beta):
    rng = np.random.default_rng(0)
    s = _log_softmax(rng.normal(size=(3, 4, 6)) * 2).astype(np.float32)
    t = _log_softmax(rng.normal(size=(3, 4, 6)) * 2).astype(np.float32)
    got = np.asarray(algorithms.generalized_jsd_tokens(s, t, beta))
    np.testing.assert_allclose(got, np_jsd(s, t, beta), rtol=1e-5, atol=1e-6)
    if 0 < beta < 1:   # a divergence: 0 at P = Q, symmetric at beta = 1/2
        np.testing.assert_allclose(algorithms.generalized_jsd_tokens(t, t, beta), 0, atol=1e-6)
    # Gradient of the summed JSD with respect to the student's log-probs, against central
    # differences of the float64 formula.
    grad = np.asarray(jax.grad(lambda x: algorithms.generalized_jsd_tokens(x, t, beta).sum())(
        jnp.asarray(s)))
    s64, eps, want = s.astype(np.float64), 1e-6, np.zeros(s.shape)
    for idx in np.ndindex(s.shape):
        up, down = s64.copy(), s64.copy()
        up[idx] += eps
        down[idx] -= eps
        want[idx] = (np_jsd(up, t, beta).sum() - np_jsd(down, t, beta).sum()) / (2 * eps)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)
    # No gradient reaches the teacher.
    g_t = jax.grad(lambda x: algorithms.generalized_jsd_tokens(s, x, beta).sum())(jnp.asarray(t))
    np.testing.assert_array_equal(np.asarray(g_t), 0.0)


def test_distill_advantages_are_minus_the_reverse_kl_plus_the_weighted_task_advantage():
    rng = np.random.default_rng(1)
    logps = -rng.uniform(0.1, 3, (4, 5)).astype(np.float32)
    teacher = -rng.uniform(0.1, 3, (4, 5)).astype(np.float32)
    mask = rng.uniform(size=(4, 5)) < 0.7
    task = rng.normal(size=4).astype(np.float32)
    np.testing.assert_allclose(algorithms.reverse_kl_tokens(logps, teacher), logps - teacher)
    got = algorithms.distill_advantages(logps, teacher, mask, task, kl_weight=0.5,
                                        reward_weight=2.0)
    want = np.where(mask, -0.5 * (logps - teacher) + 2.0 * task[:, None], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    task_tokens = rng.normal(size=(4, 5)).astype(np.float32)   # a token-level estimator
    got = algorithms.distill_advantages(logps, teacher, mask, task_tokens, reward_weight=1.0)
    np.testing.assert_allclose(got, np.where(mask, teacher - logps + task_tokens, 0.0),
                               rtol=1e-6, atol=1e-6)
    hits, n = algorithms.teacher_agreement(np.array([[1, 2], [3, 4]]), np.array([[1, 0], [3, 4]]),
                                           np.array([[True, True], [True, False]]))
    assert (float(hits), float(n)) == (2.0, 3.0)


def test_the_distillation_loss_gradient_is_the_reverse_kl_policy_gradient():
    """One update per rollout (ratio 1, token-mean): d loss / d log pi(y_t) = -A_t / tokens
    with A_t = log pi_T(y_t) - log pi(y_t) of the pre-update student."""
    rng = np.random.default_rng(2)
    logps = jnp.asarray(-rng.uniform(0.1, 3, (3, 4)), jnp.float32)
    teacher = jnp.asarray(-rng.uniform(0.1, 3, (3, 4)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(3, 4)) < 0.8)

    def loss(lp):
        old = jax.lax.stop_gradient(lp)
        adv = algorithms.distill_advantages(old, teacher, mask)
        pg, _ = algorithms.get_policy_loss("ppo")(lp, old, adv, mask)
        s, w = algorithms.aggregate(pg, mask, "token-mean")
        return s / w

    want = np.where(mask, (np.asarray(logps) - np.asarray(teacher)) / float(mask.sum()), 0.0)
    np.testing.assert_allclose(jax.grad(loss)(logps), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- the update


def distill_batch(seed=0, k=3):
    batch = make_batch(seed)
    rng = np.random.default_rng(seed + 10)
    n = batch["loss_mask"].shape[1]
    batch["teacher_logps"] = (-rng.uniform(0.5, 4.0, (len(batch["tokens"]), n))
                              * batch["loss_mask"]).astype(np.float32)
    ids = np.stack([rng.permutation(np.arange(4, MODEL.vocab_size))[:k]
                    for _ in range(len(batch["tokens"]) * n)])
    batch["teacher_topk_ids"] = ids.reshape(-1, n, k).astype(np.int32)
    batch["teacher_topk_logps"] = np.log(rng.dirichlet(np.ones(k), (len(ids),))).reshape(
        -1, n, k).astype(np.float32) - 0.5
    return batch


@pytest.mark.parametrize("num_micro", [2, 4])
def test_distill_update_is_exact_under_micro_batching(num_micro):
    algo = algo_cfg(name="distill", beta=0.0, shared_prompt=False)
    algo.distill.update(teacher="t", reward_weight=0.5, jsd_weight=0.7, jsd_beta=0.3)
    batch = distill_batch()
    del batch["old_logps"]   # one update per rollout: the update's own log-probs are "old"
    state, opt = fresh_state(lr=1.0, name="sgd")
    ref_state, ref_m = scanned_grpo_step(MODEL, algo, opt, num_micro=1)(state, batch)
    assert float(ref_m["distill/jsd"]) > 0 and abs(float(ref_m["distill/reverse_kl"])) > 0
    for step in (scanned_grpo_step(MODEL, algo, opt, num_micro=num_micro),
                 grpo.build_update(MODEL, algo, opt, num_micro=num_micro)):
        new_state, m = step(state, batch)
        for key in ("loss", "pg_loss", "distill/reverse_kl", "distill/jsd"):
            np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=2e-5, atol=1e-7,
                                       err_msg=key)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=1e-5, atol=1e-6),
                     new_state.params, ref_state.params)


def test_the_loss_is_the_written_out_one():
    """loss = token-mean over the batch of -A_t * ratio(=1) + jsd_weight * JSD_t, with the
    student's log-probs of the teacher's top-k from the same head pass."""
    from rljax.train.core import steps
    algo = algo_cfg(name="distill", beta=0.0, shared_prompt=False)
    algo.distill.update(teacher="t", jsd_weight=0.7, jsd_beta=0.3)
    batch = distill_batch(1)
    del batch["old_logps"]
    state, _ = fresh_state()
    logps, _, top = steps.completion_logps(MODEL, state.params, batch,
                                           extra_ids=batch["teacher_topk_ids"])
    m = batch["loss_mask"]
    adv = np.asarray(batch["teacher_logps"]) - np.asarray(logps)
    jsd = np_jsd(np.asarray(top), batch["teacher_topk_logps"], 0.3)
    want = np.where(m, -adv + 0.7 * jsd, 0.0).sum() / m.sum()
    (s, w), _ = grpo.grpo_loss(MODEL, algo, 1.0, state.params, state, batch)
    np.testing.assert_allclose(float(s / w), want, rtol=1e-5, atol=1e-6)
    # The extra ids' log-probs are the full log-softmax's at those ids.
    from rljax import models
    logits = models.forward(MODEL, state.params, batch["tokens"], attention_mask=batch["mask"])
    n = m.shape[1]
    lsm = np.asarray(jax.nn.log_softmax(logits[:, -n - 1:-1]))
    want_top = np.take_along_axis(lsm, batch["teacher_topk_ids"], axis=-1)
    np.testing.assert_allclose(np.where(m[..., None], top, 0), np.where(m[..., None], want_top, 0),
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the teacher


def write_teacher_workdir(path, cfg=None, alphabet=None, steps=(3,), seed=0):
    """An rljax workdir holding ``params`` checkpoints at ``steps`` (what a run saves, less
    the optimizer), its config.json and char tokenizer: a teacher without training one."""
    from rljax import models
    cfg = cfg or tiny_cfg()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config_lib.to_json(cfg))
    tok = tokenizers.CharTokenizer(alphabet) if alphabet else tokenizers.CharTokenizer()
    tok.save(str(path))
    mcfg = teacher_lib.model_config(teacher_lib.Source("workdir", str(path), tok, cfg.model.dtype,
                                                       cfg))
    saved = {}
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(str(path)), max_to_keep=5,
                                      async_save=False) as ckpt:
        for i, step in enumerate(steps):
            params = models.init_params(mcfg, jax.random.PRNGKey(seed + i))
            ckpt.save(step, {"params": params, "step": jnp.asarray(step)}, {"phase": 0},
                      wait=True)
            saved[step] = params
    return saved


def final_step(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        return ckpt.latest_step()


def distill_cfg(teacher, **overrides):
    return tiny_cfg(**{"algo.name": "distill", "algo.beta": 0.0, "algo.distill.teacher": teacher,
                       **overrides})


def test_teacher_from_a_workdir_latest_or_chosen_step(tmp_path):
    saved = write_teacher_workdir(tmp_path / "teacher", steps=(2, 5))
    mesh = jax.sharding.Mesh(np.array(DEVICES), ("data",))
    for step, want in ((0, 5), (2, 2)):
        cfg = distill_cfg(str(tmp_path / "teacher"), **{"algo.distill.teacher_step": step})
        source = teacher_lib.check(cfg)
        assert source.kind == "workdir" and source.step_dir.endswith(f"/{want}")
        _, params = teacher_lib.load(source, mesh)
        jax.tree.map(np.testing.assert_array_equal, params, saved[want])
    cfg = distill_cfg(str(tmp_path / "teacher"), **{"algo.distill.teacher_step": 4})
    with pytest.raises(UserError, match=r"teacher_step=4 is not saved .*\[2, 5\]"):
        teacher_lib.check(cfg)


def test_a_quantized_teacher_scores_close_to_its_float_weights(tmp_path):
    """``algo.distill.teacher_quantize=int8``: the teacher's projections are held as int8 codes
    on device (what the plan sizes too), and its per-token log-probs of a batch stay within
    0.05 nats of the float teacher's; ``keep`` is refused for a teacher that is not a GGUF
    file, and the key for a run that is not distilling."""
    from rljax.models import quant
    write_teacher_workdir(tmp_path / "teacher", seed=3)
    mesh = jax.sharding.Mesh(np.array(DEVICES), ("data",))
    batch = make_batch(1)
    scores, sizes = {}, {}
    for qtype in ("", "int8"):
        cfg = distill_cfg(str(tmp_path / "teacher"), **{"algo.distill.teacher_quantize": qtype})
        config_lib.validate(cfg)
        source = teacher_lib.check(cfg)
        mcfg, params = teacher_lib.load(source, mesh)
        assert quant.is_quantized(params["layers"]["q"]) == bool(qtype)
        abstract = teacher_lib.abstract_params(mcfg, mesh, source)
        assert (jax.tree.structure(abstract) == jax.tree.structure(params))
        sizes[qtype] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        score = teacher_lib.build_score_fn(mcfg, vocab=mcfg.vocab_size, mesh=mesh,
                                           param_shardings=teacher_lib.shardings(mcfg, mesh,
                                                                                 source))
        scores[qtype] = np.asarray(score(params, batch)["teacher_logps"])
    real = np.asarray(batch["loss_mask"], bool)
    diff = np.abs(scores["int8"] - scores[""])[real]
    assert 0 < diff.max() < 0.05, diff.max()
    assert sizes["int8"] < 0.6 * sizes[""]
    cfg = distill_cfg(str(tmp_path / "teacher"), **{"algo.distill.teacher_quantize": "keep"})
    with pytest.raises(ConfigError, match="teacher_quantize='keep' keeps a GGUF file's own"):
        teacher_lib.check(cfg)
    with pytest.raises(ConfigError, match="teacher_quantize is read by algo.name='distill'"):
        config_lib.validate(tiny_cfg(**{"algo.distill.teacher_quantize": "int8"}))


@pytest.mark.parametrize("alphabet, problem", [
    ("0123456789+-= ", "vocab size 100 \\(student\\) vs 18 \\(teacher\\)"),
    (tokenizers.DEFAULT_ALPHABET[::-1], "token id 4 is '0' for the student, '\\\\n' for the "
                                        "teacher"),
])
def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, alphabet, problem):
    write_teacher_workdir(tmp_path / "teacher", alphabet=alphabet)
    cfg = distill_cfg(str(tmp_path / "teacher"))
    with pytest.raises(UserError, match="does not share the student's tokenizer: " + problem) \
            as e:
        inputs.check_inputs(cfg, 1)   # before any model is built
    assert "\n" not in str(e.value)


def test_a_teacher_whose_padded_vocab_differs_is_refused_in_one_line(tmp_path):
    """Same tokenizer, padded heads of different sizes (as between Qwen2.5 sizes): refused
    before any model is built, not a run whose every update is skipped."""
    teacher_cfg = tiny_cfg()
    teacher_cfg.model.overrides = {**dict(teacher_cfg.model.overrides), "vocab_size": 128}
    write_teacher_workdir(tmp_path / "teacher", cfg=teacher_cfg)
    cfg = distill_cfg(str(tmp_path / "teacher"))
    with pytest.raises(UserError, match="the teacher's head has 128 rows, the student's 100") \
            as e:
        inputs.check_inputs(cfg, 1)
    assert "\n" not in str(e.value)
    cfg.model.overrides = {**dict(cfg.model.overrides), "vocab_size": 128}
    inputs.check_inputs(cfg, 1)   # padded alike: accepted


def test_distill_config_needs_a_teacher_and_a_teacher_needs_distill(tmp_path):
    cfg = tiny_cfg()
    cfg.algo.name = "distill"
    with pytest.raises(ConfigError, match="needs algo.distill.teacher"):
        config_lib.validate(cfg)
    cfg = tiny_cfg()
    cfg.algo.distill.teacher = str(tmp_path)
    with pytest.raises(ConfigError, match="read by algo.name='distill' only"):
        config_lib.validate(cfg)
    with pytest.raises(UserError, match="neither an HF checkpoint directory"):
        teacher_lib.check(distill_cfg(str(tmp_path)))


def test_a_lora_distill_run_stops_and_resumes_exactly(tmp_path):
    """Teacher = a workdir (other weights than the student's); a LoRA student with the JSD
    term and the task reward mixed in. A run stopped after its first distillation step and
    resumed (the teacher reloaded from its source) equals the straight run, metrics and
    adapters; only the adapters train; the student is evaluated without its teacher."""
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    overrides = {"algo.distill.jsd_weight": 0.5, "algo.distill.top_k": 4, "steps": 2,
                 "algo.micro_batch_size": 4, "algo.distill.reward_weight": 0.5,
                 "model.lora.rank": 4, "optimizer.learning_rate": 1e-2}
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    cfg = lambda: distill_cfg(str(tmp_path / "teacher"), **overrides)   # noqa: E731
    assert run.train(cfg(), straight, devices=DEVICES) == 0
    assert run.train(cfg(), split, devices=DEVICES, stop=StopAfter(3)) == 0
    assert run.train(cfg(), split, devices=DEVICES) == 0
    records = read_metrics(straight)
    rl = [r for r in records if "distill/reverse_kl" in r]
    assert len(rl) == 2 and all(r["distill/reverse_kl"] > 0 and r["distill/jsd"] > 0 and
                                0 <= r["distill/teacher_agreement"] <= 1 and r["skipped"] == 0
                                for r in rl)
    assert comparable(read_metrics(split)) == comparable(records)
    assert set(final_params(straight)) == {"lora"}   # the base never moves
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))
    with open(os.path.join(straight, "config.json")) as f:
        assert json.load(f)["algo"]["beta"] == 0.0   # distillation's default: no reference
    # The student is evaluated without its teacher.
    shutil.rmtree(tmp_path / "teacher")
    from rljax.train import inference
    _, _, step = inference.load_for_inference(config_lib.load_config_json(
        os.path.join(straight, "config.json")), straight, devices=DEVICES)
    assert step == final_step(straight)


def test_distillation_with_partial_rollouts_scores_the_carried_groups(tmp_path):
    """The teacher is a rollout stage, so it scores whatever sampler built the batch: here the
    partial-rollout pool, whose groups carry over iterations, with MoPPS choosing the prompts
    (stopped and resumed, equal: the pool and the posteriors are checkpointed)."""
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    cfg = lambda: distill_cfg(str(tmp_path / "teacher"), **{  # noqa: E731
        "rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 4, "steps": 3,
        "sft.steps": 0, "rollout.max_new_tokens": 6, "data.selection.name": "predicted"})
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run.train(cfg(), straight, devices=DEVICES) == 0
    assert run.train(cfg(), split, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg(), split, devices=DEVICES) == 0
    rl = [r for r in read_metrics(straight) if "distill/reverse_kl" in r]
    assert len(rl) == 3 and all(0 <= r["distill/teacher_agreement"] <= 1 for r in rl)
    assert any(r["rollout/carried_groups"] > 0 for r in rl)
    assert [r["selection/tracked"] for r in rl][-1] > 0   # MoPPS learned completed groups
    assert comparable(read_metrics(split)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))


def test_distillation_with_knapsack_allocation_resumes_exactly(tmp_path):
    """rollout.allocation='knapsack': the teacher scores rows in groups of the knapsack's
    sizes (sized by the task reward's pass rates, whose advantage is mixed in over each
    group's own rows), and a run stopped after its first iteration and resumed (the pass-rate
    posteriors saved) equals the straight one."""
    from test_knapsack import REWARD, phase_resumes_exactly
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = distill_cfg(str(tmp_path / "teacher"), **{
        "steps": 2, "sft.steps": 0, "algo.distill.reward_weight": 0.5,
        "rollout.max_new_tokens": 6,   # (varied rewards: completions of odd and even length)
        "reward.names": (f"{reward}:even_length",), "data.kwargs.num_examples": 4,
        "rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 1,
        "rollout.knapsack.max_samples": 8})
    rl = phase_resumes_exactly(cfg, tmp_path, steps=2, saved_after=1)
    assert all(0 <= r["distill/teacher_agreement"] <= 1 and np.isfinite(r["distill/reverse_kl"])
               and r["reward/std"] > 0 for r in rl)   # a task advantage to mix in
    assert rl[1]["rollout/group_size_max"] > rl[1]["rollout/group_size_min"]   # re-sized


@pytest.mark.parametrize("tree", [False, True])
def test_distillation_on_the_slot_engine(tmp_path, tree):
    """The teacher scores what the slot engine sampled: completions (of a mixture-of-experts
    student with routing replay: the engine records each token's experts, the student's
    passes replay them, the dense teacher scores as it is), or a tree's leaves
    (``rollout.tree``, the forks served as requests; shared segments decoded once)."""
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    trees = {"rollout.tree.enabled": True, "rollout.tree.segment_tokens": 1,
             "rollout.tree.branching": 2}
    moe = {"model.preset": "tiny-moe", "algo.routing_replay": True}
    cfg = distill_cfg(str(tmp_path / "teacher"), **{
        "rollout.engine": "slots", "rollout.slots": 4, "steps": 2, "sft.steps": 0,
        **(trees if tree else moe)})
    if not tree:
        cfg.model.overrides = dict(cfg.model.overrides, moe_intermediate_size=16)
    assert run.train(config_lib.validate(cfg), str(tmp_path / "run"), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path / "run")) if "distill/reverse_kl" in r]
    assert len(rl) == 2 and all(0 <= r["distill/teacher_agreement"] <= 1 and
                                0 < r["rollout/slot_utilisation"] <= 1 and
                                np.isfinite(r["distill/reverse_kl"]) for r in rl)
    assert all((r["rollout/decoded_tokens"] < r["rollout/tokens"]) == tree for r in rl)
    assert tree or all(r["rollout/logp_diff_max"] < 1e-4 for r in rl)


def test_asynchronous_distillation_resumes_exactly(tmp_path):
    """algo.asynchronous: the teacher scores each batch where it is sampled, a version ahead;
    the batch in flight (with its teacher log-probs) is saved with the checkpoint, so a run
    stopped and resumed equals the straight run."""
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    cfg = lambda: distill_cfg(str(tmp_path / "teacher"), **{  # noqa: E731
        "algo.asynchronous": True, "steps": 3, "sft.steps": 0, "optimizer.learning_rate": 1e-2})
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run.train(cfg(), straight, devices=DEVICES) == 0
    assert run.train(cfg(), split, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg(), split, devices=DEVICES) == 0
    rl = [r for r in read_metrics(straight) if "distill/reverse_kl" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1]
    # A per-token estimate over a few samples (of an older version's draws after the first).
    assert all(np.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0
               for r in rl)
    assert comparable(read_metrics(split)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))


def test_distillation_over_episodes_scores_whole_trajectories_and_resumes_exactly(
        tmp_path):
    """The teacher stage composes with the episodes' round source: it scores each whole
    trajectory (tool results are context: its log-probs equal a forward pass of the teacher
    over the episode, written out here), the loss and the agreement count the model's own
    tokens only, and a run stopped and resumed equals the straight run."""
    import optax

    from rljax import models
    from rljax.train.core import setup
    from rljax.train.core.rollout import Rollout
    from rljax.train.core.state import create_train_state
    from rljax.train.methods.agent import EpisodeRounds
    from rljax.train.phases.distill import TeacherScores
    from test_agent_train import agent_cfg

    def cfg():   # an environment that answers every turn, so episodes hold observations
        c = agent_cfg(**{"algo.name": "distill", "steps": 2, "sft.steps": 0,
                         "sft.env_traces": False, "env.name": "test_echo", "env.tools": (),
                         "rollout.max_new_tokens": 8,
                         "algo.distill.teacher": str(tmp_path / "teacher")})
        c.env.kwargs = {}
        return c

    write_teacher_workdir(tmp_path / "teacher", cfg=agent_cfg(), seed=7)
    ctx = setup.build_context(cfg(), str(tmp_path / "probe"), devices=DEVICES)
    stage = TeacherScores(ctx)
    rollout = Rollout(ctx, setup.data_iterator(ctx, 2), rounds=EpisodeRounds(ctx),
                      stages=[stage])
    batch, metrics = rollout(create_train_state(ctx.params, optax.sgd(0.1),
                                                jax.random.key(0)), 0)
    n = batch["loss_mask"].shape[1]
    model = np.asarray(batch["model_mask"], bool)
    observed = np.asarray(batch["mask"], bool)[:, -n:] & ~model
    assert observed.any(), "the episodes should hold tool results"
    np.testing.assert_array_equal(batch["loss_mask"], model)
    teacher_cfg, teacher_params = teacher_lib.load(teacher_lib.check(ctx.cfg), ctx.mesh)
    logits = np.asarray(models.forward(teacher_cfg, teacher_params, batch["tokens"],
                                       attention_mask=batch["mask"]), np.float64)
    logps = _log_softmax(logits[:, -n - 1:-1])
    tokens = np.asarray(batch["tokens"])[:, -n:]
    want = np.take_along_axis(logps, tokens[..., None], axis=-1)[..., 0]
    real = np.asarray(batch["mask"], bool)[:, -n:]
    np.testing.assert_allclose(np.asarray(batch["teacher_logps"])[real], want[real],
                               rtol=1e-4, atol=1e-4)
    agree = logps.argmax(-1) == tokens
    assert metrics["distill/teacher_agreement"] == pytest.approx(agree[model].mean())

    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1, devices=DEVICES)
    rl = [r for r in read_metrics(straight) if "distill/reverse_kl" in r]
    assert len(rl) == 2 and all(np.isfinite(r["distill/reverse_kl"]) and "env/turns_mean" in r
                                for r in rl)


@pytest.mark.parametrize("name", ["distill_arithmetic", "distill_smollm2"])
def test_the_distill_configs_load(name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load_config(os.path.join(root, "configs", name + ".py"))
    assert cfg.algo.name == "distill" and cfg.algo.beta == 0.0
    assert cfg.algo.distill.teacher and cfg.algo.distill.reward_weight == 0.0


def test_an_hf_teacher_directory_without_tokenizer_files_is_refused(tmp_path):
    from rljax import models
    cfg = tiny_cfg()
    mcfg = teacher_lib.model_config(teacher_lib.Source(
        "workdir", "", tokenizers.CharTokenizer(), "float32", cfg))
    models.save_hf(mcfg, models.init_params(mcfg, jax.random.PRNGKey(0)), str(tmp_path / "hf"))
    with pytest.raises(UserError, match=r"algo.distill.teacher=.*hf.*tokenizer"):
        teacher_lib.check(distill_cfg(str(tmp_path / "hf")))


# The demo's two configs made fast: a few steps and examples, no evals or TensorBoard.
FAST_DEMO = ("steps=1", "eval_every=0", "checkpoint_every=0", "sft.steps=2", "sft.batch_size=8",
             "rollout.batch_size=16", "algo.num_generations=4", "eval.num_examples=8",
             "eval.batch_size=8", "data.kwargs.eval_examples=8", "logging.tensorboard=false",
             "checkpoint.async_save=false")


def test_the_shipped_distill_config_reads_its_teacher_by_a_relative_path(tmp_path, monkeypatch):
    """configs/distill_arithmetic.py names its teacher ``runs/demo``, relative to the working
    directory: the demo trained there (made fast) is the teacher of the distillation run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(tmp_path)
    teacher = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic.py"),
                                     FAST_DEMO)
    assert run.train(teacher, "runs/demo", devices=DEVICES) == 0
    student = config_lib.load_config(os.path.join(root, "configs", "distill_arithmetic.py"),
                                     FAST_DEMO)
    assert student.algo.distill.teacher == "runs/demo"
    assert run.train(student, "runs/distill", devices=DEVICES) == 0
    assert [r for r in read_metrics("runs/distill") if "distill/reverse_kl" in r]


def test_a_teacher_checkpoint_that_does_not_fit_its_config_is_refused_before_the_warm_up(
        tmp_path, capsys):
    """A workdir teacher whose config.json describes another model than its checkpoint holds:
    one line naming the parameter, from the input checks, before the SFT warm-up (no student
    checkpoint is written)."""
    write_teacher_workdir(tmp_path / "teacher")
    with open(tmp_path / "teacher" / "config.json") as f:
        data = json.load(f)
    data["model"]["overrides"]["hidden_size"] = 48
    with open(tmp_path / "teacher" / "config.json", "w") as f:
        json.dump(data, f)
    cfg = distill_cfg(str(tmp_path / "teacher"))
    with pytest.raises(UserError, match=r"does not fit .*config.json: params\['embed'\] is "
                                        r"\(100, 32\) in the checkpoint, \(100, 48\) by the "
                                        r"config") as e:
        inputs.check_inputs(cfg, 1)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="does not fit"):
        run.train(cfg, str(tmp_path / "student"), devices=DEVICES)
    assert not os.path.isdir(checkpoint.checkpoint_dir(str(tmp_path / "student"))) or \
        not os.listdir(checkpoint.checkpoint_dir(str(tmp_path / "student")))


@pytest.mark.parametrize("teacher_temperature", [1.0, 0.5])
def test_the_teacher_is_scored_at_its_own_temperature_not_the_rollouts(tmp_path,
                                                                        teacher_temperature):
    """``algo.distill.teacher_temperature`` (default 1, the published form) is the temperature
    of the teacher's log-probs, whatever the rollout samples at: they equal
    log_softmax(logits / T) written out, for the sampled tokens and the top-k."""
    import types

    from rljax import models
    from rljax.train.phases import distill
    write_teacher_workdir(tmp_path / "teacher", seed=5)
    overrides = {"rollout.temperature": 0.7, "algo.distill.jsd_weight": 0.5,
                 "algo.distill.top_k": 3}
    if teacher_temperature != 1.0:
        overrides["algo.distill.teacher_temperature"] = teacher_temperature
    cfg = distill_cfg(str(tmp_path / "teacher"), **overrides)
    assert cfg.algo.distill.teacher_temperature == teacher_temperature
    source = teacher_lib.check(cfg)
    mesh = jax.sharding.Mesh(np.array(DEVICES), ("data",))
    mcfg, params = teacher_lib.load(source, mesh)
    ctx = types.SimpleNamespace(cfg=cfg, mesh=mesh, model_cfg=mcfg)
    batch = make_batch(1)
    out = distill.score_fn(ctx, mcfg, source)(params, batch)
    m = np.asarray(batch["mask"])
    n = batch["loss_mask"].shape[1]
    logits = np.asarray(models.forward(mcfg, params, batch["tokens"],
                                       attention_mask=batch["mask"]), np.float64)
    want_all = _log_softmax(logits[:, -n - 1:-1] / teacher_temperature)
    tok = np.asarray(batch["tokens"])[:, -n:]
    want = np.take_along_axis(want_all, tok[..., None], axis=-1)[..., 0]
    real = m[:, -n:].astype(bool)
    np.testing.assert_allclose(np.asarray(out["teacher_logps"])[real], want[real], rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(out["teacher_topk_logps"]),
                               -np.sort(-want_all, axis=-1)[..., :3], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("guide", ["hints", "demos"])
def test_distillation_with_hints_relift_or_demonstrations(tmp_path, guide):
    """Guidance is part of GRPO's rollout, which distillation shares: failed groups are hinted
    (or end in the reference solution, mu = 1) and ReLIFT's SFT step runs, and the teacher
    scores those rows as any other (its reverse KL mixed with the task advantage)."""
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    guided = ({"algo.hint.mode": "fixed", "algo.hint.fraction": 0.5, "algo.relift.every": 1,
               "algo.relift.batch_size": 4, "algo.relift.k_visits": 1}
              if guide == "hints" else {"algo.mixed_policy": True})
    cfg = distill_cfg(str(tmp_path / "teacher"), **{
        "steps": 2, "sft.steps": 0, "algo.distill.reward_weight": 0.5,
        "algo.mini_batch_size": 0, **guided})
    assert run.train(config_lib.validate(cfg), str(tmp_path / "run"), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path / "run")) if "distill/reverse_kl" in r]
    assert len(rl) == 2 and all(np.isfinite(r["distill/reverse_kl"]) and
                                0 <= r["distill/teacher_agreement"] <= 1 for r in rl)
    if guide == "hints":
        assert all(r["hint/fraction_hinted"] > 0 for r in rl)
        assert any(np.isfinite(r.get("relift/sft_loss", np.nan)) for r in rl)
    else:
        assert all(r["mixed/demos"] > 0 for r in rl)
        # The demonstrations' reverse KL is the student's own log-probs against the teacher's
        # (about 0 between these two tiny models), not mu = 1's zeros (about 0.9 here).
        assert all(abs(r["distill/reverse_kl"]) < 0.3 for r in rl)
