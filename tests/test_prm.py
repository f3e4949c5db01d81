"""Process reward model (algo.name="prm"): TRL PRMTrainer's label placement and loss written out
and compared, Math-Shepherd labels recomputed from their continuation texts, AUROC and step
score aggregation, bad stepwise input refused in one line, and a tiny run that resumes."""
import json
import os
import subprocess
import sys
import types
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms, models, rewards
from rljax import config as config_lib
from rljax.data import stepwise
from rljax.rewards.combine import RewardResult
from rljax.tokenizers import CharTokenizer
from rljax.train.methods import prm_labels, step_mc
from rljax.train.phases import prm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()
ROWS = [
    {"prompt": "1+2+3=", "completions": ["1+2=3", "3+3=6"], "labels": [True, True]},
    {"prompt": "4-1+2=", "completions": ["4-1=2", "2+2=4"], "labels": [False, False]},
    {"prompt": "9-9=", "completions": ["9-9=0"], "labels": [True]},
]


def _model():
    cfg = models.get_preset("tiny", vocab_size=TOK.vocab_size, num_layers=1, hidden_size=32,
                            intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    policy = models.init_params(cfg, jax.random.key(0))
    return cfg, models.init_value_params(cfg, jax.random.key(1), from_params=policy)


# ----------------------------------------------------------------------------- TRL, written out

def trl_tokenize_row(tokenizer, row, separator):
    """TRL PRMTrainer.tokenize_row (no truncation, train_on_last_step_only=False) restated:
    each step tokenized alone plus the separator's tokens, the label on the last of them,
    -100 elsewhere; BOS before the prompt when the tokenizer has one."""
    prompt_ids = tokenizer.encode(row["prompt"])
    sep = tokenizer.encode(separator)
    steps = [tokenizer.encode(c) + sep for c in row["completions"]]
    labels = [[-100] * (len(s) - 1) + [int(y)] for s, y in zip(steps, row["labels"])]
    if tokenizer.bos_id is not None:
        prompt_ids = [tokenizer.bos_id] + prompt_ids
    return (prompt_ids + list(chain(*steps)),
            [-100] * len(prompt_ids) + list(chain(*labels)))


def trl_loss(logits2, labels):
    """Token-classification cross-entropy (2 classes, ignore_index=-100), mean over the
    labelled tokens of all rows (HF's loss for AutoModelForTokenClassification)."""
    total, n = 0.0, 0
    for lg, lab in zip(logits2, labels):
        for t, y in enumerate(lab):
            if y == -100:
                continue
            z = lg[t].astype(np.float64)
            total += np.logaddexp.reduce(z) - z[y]
            n += 1
    return total / n


def test_label_placement_and_loss_equal_trls_formulation():
    cfg, value = _model()
    enc = [stepwise.encode_row(TOK, r["prompt"], r["completions"], r["labels"], "\n",
                               add_bos=True) for r in ROWS]
    batch = stepwise.stepwise_batch(enc, 4, 8, 14, TOK.pad_id)   # one padding row
    (loss_sum, weight), _ = jax.jit(lambda v, b: prm.prm_loss(cfg, v, None, b))(value, batch)

    trl_logits, trl_labels = [], []
    for i, row in enumerate(ROWS):
        input_ids, labels = trl_tokenize_row(TOK, row, "\n")
        # Same tokens and the same labels, token by token, as the batch's row i.
        p = batch["prompt_mask"][i]
        c = batch["completion_mask"][i]
        ours_ids = batch["prompt_tokens"][i][p].tolist() + batch["completion_tokens"][i][c].tolist()
        ours_labels = [-100] * int(p.sum()) + [
            int(y) if m else -100 for y, m in zip(batch["labels"][i][c], batch["label_mask"][i][c])]
        assert ours_ids == input_ids and ours_labels == labels
        # TRL's model: two class logits per token; a scalar logit s is the class pair (0, s).
        s = np.asarray(models.value_forward(cfg, value, jnp.asarray([input_ids])))[0]
        trl_logits.append(np.stack([np.zeros_like(s), s], axis=1))
        trl_labels.append(labels)
    assert float(weight) == 5.0   # five steps; the padding row has none
    np.testing.assert_allclose(float(loss_sum) / float(weight), trl_loss(trl_logits, trl_labels),
                               rtol=2e-6)


def test_soft_labels_are_cross_entropy_against_the_fraction():
    logits = jnp.array([[0.3, -1.2, 2.0]])
    labels = jnp.array([[0.25, 1.0, 0.0]])
    mask = jnp.array([[True, True, False]])
    total, weight = algorithms.process_reward_loss(logits, labels, mask)
    z = np.stack([np.zeros(3), np.asarray(logits[0], np.float64)], 1)
    logp = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
    y = np.asarray(labels[0], np.float64)
    ref = -(((1 - y) * logp[:, 0] + y * logp[:, 1])[:2]).sum()
    np.testing.assert_allclose(float(total), ref, rtol=1e-6)
    assert float(weight) == 2.0


def test_auroc_counts_pairs_and_ties_and_step_scores_aggregate():
    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 4, 40).astype(float), rng.random(40) < 0.4
    pairs = [(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]]
    assert algorithms.auroc(s, y) == pytest.approx(np.mean(pairs))
    assert np.isnan(algorithms.auroc([1.0, 2.0], [True, True]))
    probs = jnp.array([[0.9, 0.2, 0.7], [0.5, 0.0, 0.0], [0.3, 0.3, 0.3]])
    mask = jnp.array([[True, True, True], [True, False, False], [False, False, False]])
    for mode, want in (("min", [0.2, 0.5, 0.0]), ("last", [0.7, 0.5, 0.0]),
                       ("mean", [0.6, 0.5, 0.0]), ("prod", [0.126, 0.5, 0.0])):
        np.testing.assert_allclose(algorithms.aggregate_step_scores(probs, mask, mode), want,
                                   rtol=1e-6)


def test_corrupted_solutions_carry_the_error_forward():
    rows = stepwise.corrupted_solutions("1+2+3-4=", "1+2=3\n3+3=6\n6-4=2",
                                        np.random.default_rng(3))
    good, bad = rows
    assert good["labels"] == [True, True, True]
    j = bad["labels"].index(False)
    assert bad["labels"] == [k < j for k in range(3)] and bad["completions"][:j] == \
        good["completions"][:j]
    verify = rewards.get("arithmetic")
    assert verify(["q"], ["\n".join(bad["completions"])], answer=["2"]) == [0.0]


# ----------------------------------------------------------------------------- Math-Shepherd

PROMPT = "1+2+3="
SAMPLES = {   # prompt text fed to the sampler -> its K=4 continuations
    PROMPT: ["1+2=3\n3+3=6", "1+2=4\n4+3=7", "1+2=3\n3+3=5", "1+2=3\n3+3=6"],
    PROMPT + "1+2=3\n": ["3+3=6", "3+3=7", "3+3=6", "3+3=1"],
    PROMPT + "1+2=4\n": ["4+3=7", "4+3=6", "4+3=8", "4+3=7"],
}


def scripted_labels(monkeypatch, soft):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "algo.name": "prm", "algo.num_generations": 4, "rollout.batch_size": 4,
        "rollout.max_new_tokens": 12, "data.max_prompt_length": 8,
        "algo.step_mc.max_steps": 2, "algo.prm.soft_labels": soft})
    config_lib.validate(cfg)

    def fake_generate(ctx, params, p_tok, p_mask, rng, *, num_samples, max_new_tokens, **kw):
        rows = [TOK.encode(c) + [TOK.eos_id] for p in TOK.batch_decode(p_tok, p_mask)
                for c in SAMPLES[p]]
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        mask = np.zeros(tokens.shape, bool)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], mask[i, :len(r)] = r, True
        return {"tokens": tokens, "mask": mask, "lengths": mask.sum(1),
                "logps": np.zeros(tokens.shape, np.float32), "truncated": ~mask.any(1)}

    verify = rewards.get("arithmetic")

    def reward_fn(prompts, texts, answer=None, **_):
        total = verify(prompts, texts, answer=answer)
        return RewardResult(total=total, per_function={"arithmetic": total},
                            errors={"arithmetic": 0})

    monkeypatch.setattr(step_mc, "generate", fake_generate)
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=TOK, reward_fn=lambda: reward_fn, mesh=None)
    source = prm_labels.StepMCLabels(ctx, iter([[{"prompt": PROMPT, "answer": "6"}]]))
    return source(types.SimpleNamespace(rng=jax.random.PRNGKey(0), params=None), 0), source


@pytest.mark.parametrize("soft", [False, True])
def test_shepherd_labels_are_the_fraction_of_correct_continuations(monkeypatch, soft):
    (batch, metrics), source = scripted_labels(monkeypatch, soft)
    verify = rewards.get("arithmetic")
    details = source.last_details
    assert len(details) == 2   # one proper prefix in each of the two labelled samples
    for d in details:
        texts = d["continuations"]
        assert len(texts) == 4 and all(t.startswith(texts[0].split("\n")[0] + "\n")
                                       for t in texts)
        frac = np.mean([r >= 1.0 for r in verify(["q"] * 4, texts, answer=["6"] * 4)])
        assert d["label"] == pytest.approx(frac if soft else float(frac > 0))
    # The labelled samples: the best (sample 0, right) and the worst (sample 1, wrong).
    comps = [TOK.decode(t[m]) for t, m in zip(batch["completion_tokens"], batch["completion_mask"])]
    assert comps == ["1+2=3\n3+3=6", "1+2=4\n4+3=7"]
    # Labels on the delimiter ending step 1 and on the stop token ending step 2 (its outcome).
    for row, first in ((0, 0.5 if soft else 1.0), (1, 0.25 if soft else 1.0)):
        assert np.flatnonzero(batch["label_mask"][row]).tolist() == [5, 11]
        np.testing.assert_allclose(batch["labels"][row][[5, 11]], [first, 1.0 - row])
    assert metrics["prm/labels"] == 4 and metrics["prm/prefixes"] == 2


# ----------------------------------------------------------------------------- bad input

def _cli(tmp_path, *overrides):
    args = ["--config", os.path.join(ROOT, "configs", "prm_arithmetic_steps.py"),
            "--workdir", str(tmp_path / "w"), *overrides]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    return subprocess.run([sys.executable, "-m", "rljax.cli", "train", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_label_count_mismatch_is_one_line_exit_2(tmp_path):
    path = tmp_path / "steps.jsonl"
    rows = [ROWS[0], {"prompt": "2+2=", "completions": ["2+2=4", "4+0=4"], "labels": [True]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _cli(tmp_path, "--config.data.source=jsonl", f"--config.data.path={path}",
                "--config.sft.steps=0")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "line 2: 1 labels for 2 completions" in lines[0], proc.stderr
    assert not os.path.isdir(tmp_path / "w" / "checkpoints")


def test_config_refuses_prm_without_stepwise_source():
    for overrides, match in ((["--config.algo.name=prm", "--config.data.source=parquet",
                               "--config.data.path=x.parquet"], "data.source='jsonl'"),
                             (["--config.algo.name=prm", "--config.data.step_delimiter="],
                              "data.step_delimiter"),
                             (["--config.algo.name=prm", "--config.algo.prm.step_score=max"],
                              "algo.prm.step_score")):
        with pytest.raises(config_lib.ConfigError, match=match):
            config_lib.load_config(None, overrides)


def test_bad_rows_name_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    for row, match in (({"prompt": "x", "completions": ["a"]}, "missing field"),
                       ({"prompt": "x", "completions": [], "labels": []}, "non-empty"),
                       ({"prompt": "x", "completions": ["a"], "labels": [2]}, r"labels\[0\]=2")):
        path.write_text(json.dumps(ROWS[2]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=f"line 2: .*{match}"):
            stepwise.read_jsonl(str(path))


# ----------------------------------------------------------------------------- end to end

def tiny_prm_cfg(steps, **extra):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": steps, "eval_every": 0, "checkpoint_every": 0, "tokenizer.kind": "char",
        "data.max_prompt_length": 8, "algo.name": "prm", "algo.num_generations": 2,
        "algo.step_mc.max_steps": 2, "rollout.batch_size": 4, "rollout.max_new_tokens": 16,
        "optimizer.learning_rate": 1e-3, "sft.steps": 2, "sft.batch_size": 4,
        "sft.max_length": 26, "eval.num_examples": 4, "eval.batch_size": 4,
        "logging.tensorboard": False, "checkpoint.async_save": False, **extra})
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "operands": 3, "steps": True, "eval_examples": 4}
    return config_lib.validate(cfg)


def _comparable(workdir):
    from rljax.train.core.metrics import read_metrics
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
            for r in read_metrics(workdir)]


def _critic(workdir):
    from rljax.train.core import checkpoint
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        return jax.tree.map(np.asarray, ckpt.restore().state["critic_params"])


def test_prm_run_on_sampled_labels_resumes_exactly(tmp_path):
    """A run stopped after its first PRM update and resumed logs the same metrics and ends
    with the same PRM as a straight run (sampling keys from the train state, the data
    position from the phase's state_dict)."""
    from rljax.train import run

    from test_train_loop import StopAfter

    devices = jax.devices()[:1]
    straight, parts = str(tmp_path / "a"), str(tmp_path / "b")
    assert run.train(tiny_prm_cfg(2), straight, devices=devices) == 0
    assert run.train(tiny_prm_cfg(2), parts, devices=devices, stop=StopAfter(3)) == 0
    assert run.train(tiny_prm_cfg(2), parts, devices=devices) == 0
    updates = [r for r in _comparable(straight) if "prm/labels" in r]
    assert len(updates) == 2 and all(r["prm/rows"] == 4 and "loss" in r for r in updates)
    evals = [r for r in _comparable(straight) if "eval/step_auroc" in r]
    assert len(evals) == 1 and evals[0]["eval/steps"] == 4 * 2 * 2  # 4 problems x 2 rows x 2
    assert _comparable(parts) == _comparable(straight)
    jax.tree.map(np.testing.assert_array_equal, _critic(parts), _critic(straight))


def test_prm_learns_a_stepwise_file(tmp_path):
    from rljax.train import run

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tiny_prm_cfg(30, **{"data.source": "jsonl", "data.path": str(path),
                              "data.eval_path": str(path), "sft.steps": 0,
                              "rollout.batch_size": 3, "algo.num_generations": 1,
                              "optimizer.learning_rate": 3e-3})
    assert run.train(cfg, str(tmp_path / "w"), devices=jax.devices()[:1]) == 0
    records = _comparable(str(tmp_path / "w"))
    losses = [r["loss"] for r in records if "prm/rows" in r]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]
    final = [r for r in records if "eval/step_accuracy" in r][-1]
    assert final["eval/step_accuracy"] == 1.0 and final["eval/steps"] == 5


def test_eval_and_export_act_on_the_process_reward_model(tmp_path, capsys):
    """``rljax eval`` reports the PRM's held-out step metrics; ``rljax export`` writes an HF
    token classifier whose class-1 probability is sigmoid of rljax's logit at every token."""
    from rljax.train import run

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tiny_prm_cfg(2, **{"data.source": "jsonl", "data.path": str(path),
                             "data.eval_path": str(path), "sft.steps": 0,
                             "rollout.batch_size": 3, "algo.num_generations": 1})
    devices, workdir = jax.devices()[:1], str(tmp_path / "w")
    assert run.train(cfg, workdir, devices=devices) == 0
    capsys.readouterr()
    assert run.evaluate(cfg, workdir, devices=devices) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 2 and out["eval/steps"] == 5 and "eval/step_auroc" in out

    export_dir = str(tmp_path / "hf")
    assert run.export(cfg, workdir, export_dir, devices=devices) == 0
    assert "process reward model" in capsys.readouterr().err
    hf_cfg = json.load(open(os.path.join(export_dir, "config.json")))
    assert hf_cfg["architectures"] == ["LlamaForTokenClassification"]
    value = _critic(workdir)
    model_cfg = models.config_from_hf(hf_cfg)
    tokens = np.asarray([TOK.encode("1+2+3=1+2=3\n3+3=6\n")], np.int32)
    expected = jax.nn.sigmoid(models.value_forward(model_cfg, value, tokens))
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(export_dir).eval()
    with torch.no_grad():
        probs = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.softmax(-1)
    np.testing.assert_allclose(probs[0, :, 1].numpy(), np.asarray(expected)[0], atol=1e-5)


# ----------------------------------------------------------------------------- inference

def test_step_rows_and_completion_scores_read_the_step_ends():
    from rljax.train.methods import prm_rerank

    comps = [TOK.encode("1+2=3\n3+3=6") + [TOK.eos_id], TOK.encode("1+2=4")]
    rows = prm_rerank.step_rows([TOK.encode("1+2+3=")] * 2, comps, TOK.decode, "\n",
                                (TOK.eos_id,))
    assert [r[2] for r in rows] == [[5, 11], [4]]

    def logits_fn(batch):   # the logit of a token is its id / 10 - 3: scores known in advance
        return jnp.asarray(batch["completion_tokens"], jnp.float32) / 10 - 3

    sig = lambda ids: 1 / (1 + np.exp(-(np.asarray(ids, float) / 10 - 3)))  # noqa: E731
    got = prm_rerank.completion_scores(logits_fn, rows, 4, 8, 16, TOK.pad_id, "min")
    want = [min(sig([comps[0][5], comps[0][11]])), sig([comps[1][4]])[0]]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    last = prm_rerank.completion_scores(logits_fn, rows, 4, 8, 16, TOK.pad_id, "last")
    np.testing.assert_allclose(last, [sig([TOK.eos_id])[0], want[1]], rtol=1e-6)


def test_pair_accuracy_counts_right_over_wrong_within_a_prompt():
    from rljax.train.methods import prm_rerank

    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.2, 0.7]])
    correct = np.array([[True, False, False], [True, False, True]])
    # prompt 0: 0.9 beats 0.1 and 0.5 (2 of 2); prompt 1: 0.2 ties 0.2 (0.5), 0.7 > 0.2 (1)
    assert prm_rerank.pair_accuracy(scores, correct) == pytest.approx(3.5 / 4)
    assert np.isnan(prm_rerank.pair_accuracy(scores[:1], np.ones((1, 3), bool)))


def test_eval_best_of_n_guided_by_a_prm_run(tmp_path, capsys):
    """``rljax eval --prm``: the policy samples N per held-out problem, the PRM picks; the
    picked sample's accuracy lies between none and the oracle's (pass@N). ``--prm-beam``:
    the step-level beam search runs on the same run."""
    from rljax.train import run

    devices, workdir = jax.devices()[:1], str(tmp_path / "w")
    cfg = tiny_prm_cfg(1)
    assert run.train(cfg, workdir, devices=devices) == 0
    capsys.readouterr()
    assert run.evaluate_best_of_n(cfg, workdir, workdir, n=2, devices=devices) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval/best_of_n/num_examples"] == 4
    assert 0.0 <= out["eval/best_of_n/accuracy"] <= out["eval/best_of_n/pass@2"] <= 1.0
    assert {"eval/best_of_n/auroc", "eval/best_of_n/pair_accuracy",
            "eval/best_of_n/sample_accuracy"} <= set(out)
    assert run.evaluate_best_of_n(cfg, workdir, workdir, n=2, devices=devices, beams=2) == 0
    beam = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert beam["eval/beam/num_examples"] == 4 and 0.0 <= beam["eval/beam/accuracy"] <= 1.0
    from rljax.errors import UserError
    other = tiny_prm_cfg(1, **{"algo.name": "rm", "algo.num_generations": 1})
    (tmp_path / "rm").mkdir()
    from rljax.train.core import workdir as wd
    wd.write_config(str(tmp_path / "rm"), other)
    with pytest.raises(UserError, match="not a process reward model"):
        run.evaluate_best_of_n(cfg, workdir, str(tmp_path / "rm"), n=2, devices=devices)


def test_the_example_stepwise_file_passes_the_checks_and_encodes():
    """examples/data/prm.jsonl (docs/data.md): the checks a run makes before it compiles,
    then one batch with a label at the end of every step."""
    from rljax.train.core import setup

    path = os.path.join(ROOT, "examples", "data", "prm.jsonl")
    cfg = tiny_prm_cfg(1, **{"data.source": "jsonl", "data.path": path, "sft.steps": 0,
                             "data.max_prompt_length": 24, "rollout.max_new_tokens": 32,
                             "rollout.batch_size": 8, "algo.num_generations": 1})
    cfg.data.kwargs = {}
    setup.check_inputs(cfg, num_devices=1)
    rows = prm.read_rows(cfg, TOK, path)
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=TOK)
    batch = prm.encode_rows(ctx, rows, 8)
    assert batch["label_mask"].sum() == sum(len(r["labels"]) for r in rows) == 16
    ends = batch["completion_tokens"][batch["label_mask"]]
    assert set(TOK.decode([int(t)]) for t in ends) == {"\n"}   # each step's delimiter


def test_rows_that_do_not_fit_are_counted_in_one_line():
    rows = ROWS + [{"prompt": "1+1=", "completions": ["1+1=2" * 5], "labels": [True]}]
    with pytest.raises(ValueError, match=r"^f.jsonl: 1 of 4 rows do not fit \(row 4: 4 prompt "
                                         r"tokens, 26 step tokens"):
        stepwise.check_lengths(rows, TOK, "\n", 8, 16, "f.jsonl")
    stepwise.check_lengths(ROWS, TOK, "\n", 8, 16, "f.jsonl")


BEAM_SAMPLES = {   # prompt text fed to the sampler -> its 2 continuations
    PROMPT: ["1+2=4\n4+3=7", "1+2=3\n3+3=6"],
    PROMPT + "1+2=3\n": ["3+3=7", "3+3=6"],
    PROMPT + "1+2=4\n": ["4+3=7", "4+3=8"],
}
EOS = [TOK.eos_id]
BEAM_LOGITS = {   # completion prefix (ending at a step end) -> the scorer's logit there
    tuple(TOK.encode("1+2=3\n")): 2.0, tuple(TOK.encode("1+2=4\n")): -1.0,
    tuple(TOK.encode("1+2=3\n3+3=6") + EOS): 1.0, tuple(TOK.encode("1+2=3\n3+3=7") + EOS): -2.0}


@pytest.mark.parametrize("beams", [1, 2])
def test_beam_search_keeps_the_best_scoring_prefixes(monkeypatch, beams):
    from rljax.train.methods import prm_rerank

    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"rollout.max_new_tokens": 16, "data.max_prompt_length": 8})
    calls = []

    def fake_generate(ctx, params, p_tok, p_mask, rng, *, num_samples, max_new_tokens, **kw):
        prompts = TOK.batch_decode(p_tok, p_mask)
        calls.append(prompts)
        rows = [TOK.encode(c) + EOS for p in prompts for c in BEAM_SAMPLES[p]]
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        mask = np.zeros(tokens.shape, bool)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], mask[i, :len(r)] = r, True
        return {"tokens": tokens, "mask": mask}

    def logits_fn(batch):
        out = np.zeros(batch["completion_tokens"].shape, np.float32)
        for r, (t, m) in enumerate(zip(batch["completion_tokens"], batch["completion_mask"])):
            ids = t[m].tolist()
            for k in range(len(ids)):
                out[r, k] = BEAM_LOGITS.get(tuple(ids[:k + 1]), 0.0)
        return jnp.asarray(out)

    monkeypatch.setattr(prm_rerank, "generate", fake_generate)
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=TOK, mesh=None)
    best = prm_rerank.beam_search(ctx, None, (logits_fn, "min"), [{"prompt": PROMPT}],
                                  jax.random.PRNGKey(0), beams=beams, expand=2, temperature=1.0)
    assert best == [TOK.encode("1+2=3\n3+3=6") + EOS]
    # Depth 0 from the prompt; depth 1 from the kept prefixes, best first (static: `beams` rows).
    kept = [PROMPT + "1+2=3\n", PROMPT + "1+2=4\n"][:beams]
    assert calls == [[PROMPT] * beams, kept]
