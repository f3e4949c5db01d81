"""Bad data and bad free-form config are one line (exit 2) before anything trains: rows that are
not JSON objects or lack the template's field, non-UTF-8 files, empty files, prompts that are
all too long, sequences longer than the model's context, DPO pairs with chosen == rejected,
unknown ``model.overrides`` / ``reward.kwargs``."""
import json
import os

import pytest

from rljax import cli, data

from tiny_config import tiny_config_source

TINY = tiny_config_source()


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _train(tmp_path, capsys, *overrides):
    cfg = tmp_path / "tiny.py"
    files = any(o.startswith("--config.data.source=jsonl") for o in overrides)
    cfg.write_text(tiny_config_source(data=dict(kwargs={})) if files else TINY)
    code = cli.main(["train", "--config", str(cfg), "--workdir", str(tmp_path / "w"),
                     *overrides])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("rljax: warning")]
    return code, lines, err


def _one_line(code, lines, err, *needles):
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("rljax: error:"), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _file_data(path, eval_path=None):
    out = ["--config.data.source=jsonl", f"--config.data.path={path}"]
    return out + ([f"--config.data.eval_path={eval_path}"] if eval_path else [])


QUESTIONS = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]


def test_row_without_the_template_field_is_one_line_with_file_and_line(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "t.jsonl", QUESTIONS[:5] + [{"q": "9+1="}] + QUESTIONS[5:])
    ev = _write_jsonl(tmp_path / "e.jsonl", QUESTIONS)
    _one_line(*_train(tmp_path, capsys, *_file_data(path, ev)), f"{path}:6", "question")
    assert not os.path.isdir(tmp_path / "w" / "checkpoints")


def test_json_array_row_is_one_line_with_file_and_line(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "t.jsonl", QUESTIONS[:2] + ['["1+1=", "2"]'])
    _one_line(*_train(tmp_path, capsys, *_file_data(path)), f"{path}:3", "JSON object")


def test_non_utf8_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    first, second = b'{"question": "1+1=", "answer": "2"}\n', b'{"question": "caf\xe9", "answer": "2"}\n'
    path.write_bytes(first + second)
    offset = len(first) + second.index(b"\xe9")
    _one_line(*_train(tmp_path, capsys, *_file_data(str(path))), f"{path}:2", "UTF-8",
              f"byte offset {offset}")


def test_empty_eval_file_is_one_line_and_nothing_after(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "t.jsonl", QUESTIONS)
    ev = tmp_path / "e.jsonl"
    ev.write_text("\n")
    code, lines, err = _train(tmp_path, capsys, *_file_data(path, str(ev)))
    _one_line(code, lines, err, str(ev), "empty")
    assert "Traceback" not in err and "futures" not in err


def test_all_prompts_too_long_is_one_line_with_lengths(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"question": "x" * (20 + i), "answer": "1"}
                                               for i in range(4)])
    ev = _write_jsonl(tmp_path / "e.jsonl", QUESTIONS)
    _one_line(*_train(tmp_path, capsys, *_file_data(path, ev)), "data.max_prompt_length=8",
              "20 to 23 tokens")


def test_lazily_found_bad_row_names_file_and_line(tmp_path):
    # Past the up-front check (e.g. a huge TFDS source is scanned only partly) a bad row is
    # still a UserError naming where it is.
    path = _write_jsonl(tmp_path / "t.jsonl", QUESTIONS[:3] + [{"q": "x"}])
    it = data.make_iterator({"source": "jsonl", "path": path, "shuffle": False}, batch_size=4)
    with pytest.raises(data.DataError, match=f"{path}:4"):
        next(it)


def test_prompt_plus_new_tokens_longer_than_the_context_is_refused(tmp_path, capsys):
    _one_line(*_train(tmp_path, capsys, "--config.model.overrides.max_position_embeddings=10"),
              "max_position_embeddings=10", "data.max_prompt_length + rollout.max_new_tokens",
              "8 + 4 = 12")


def test_dpo_pairs_all_identical_are_refused_and_some_warned(tmp_path, capsys):
    same = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 1)} for i in range(8)]
    path = _write_jsonl(tmp_path / "p.jsonl", same)
    args = ["--config.algo.name=dpo", "--config.algo.beta=0.1", *_file_data(path)]
    _one_line(*_train(tmp_path, capsys, *args), path, "chosen == rejected in all 8 pairs")
    from rljax.train.core import preference_data

    mixed = same[:6] + [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2
    preference_data.check_identical_pairs(data.make_source(
        {"source": "jsonl", "kind": "preference", "path": _write_jsonl(tmp_path / "m.jsonl", mixed)}))
    assert "chosen == rejected in 6 of 8 pairs" in capsys.readouterr().err


@pytest.mark.parametrize("override,needle", [
    ("--config.model.overrides.num_layer=2", "model.overrides.num_layer: not a model setting; "
                                             "did you mean 'num_layers'"),
    ("--config.model.overrides.hidden_size=big", "model.overrides.hidden_size: expected int"),
    ("--config.model.overrides.rope_theta=fast", "model.overrides.rope_theta='fast': expected float"),
    ("--config.model.overrides.moe_plan_balanced=true",
     "model.overrides.moe_plan_balanced: set by `rljax plan`"),
    ("--config.reward.kwargs.arithmetic.tolerance=1", "reward.kwargs.arithmetic"),
    ("--config.reward.kwargs.format.pattern=1", "reward.kwargs.format"),
])
def test_bad_free_form_sections_are_one_line(tmp_path, capsys, override, needle):
    _one_line(*_train(tmp_path, capsys, override), needle)


def test_a_tfds_source_is_not_taken_for_user_code():
    """``data.source='tfds:gsm8k'`` (the notebooks' fallback without a local copy) passed for
    a ``module:function`` spec and was refused as "no module named 'tfds'"."""
    from rljax import config as config_lib
    from rljax.train.core import setup
    cfg = config_lib.default_config()
    config_lib.merge_into(cfg, dict(data=dict(source="tfds:gsm8k", path="", eval_path="",
                                              template="gsm8k"), reward=dict(names=("gsm8k",))))
    config_lib.validate(cfg)
    setup.check_inputs(cfg, 1)   # nothing is read or downloaded here
