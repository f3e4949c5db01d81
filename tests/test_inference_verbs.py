"""`rljax sample` and `rljax export` of a chat-template run, and the training console's
sampled completions: sample renders the run's data + chat templates (`--raw` bypasses them)
and separates prompt from completion; export writes a complete HF directory (tokenizer files
and chat template included, loadable by AutoTokenizer with the run's prompt ids), refuses a
non-empty --out without --overwrite and never writes into a run directory."""
import json
import os

import jax
import pytest

from rljax import cli
from rljax import config as config_lib
from rljax import models
from rljax.train import run
from rljax.train.core.evaluate import eval_examples
from rljax.train.core.setup import build_context

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
ROWS = [{"question": f"What is {a} plus {b}?", "answer": f"{a + b}"}
        for a in range(6) for b in range(4)]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny random qwen2 checkpoint with a BPE tokenizer and a chat template, trained for
    one GRPO step with `tokenizer.chat_template` and the `qa` data template."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("chat")
    raw = Tokenizer(tm.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([r["question"] + " " + r["answer"] for r in ROWS] * 4,
                            trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    model_dir = root / "model"
    tok.save_pretrained(model_dir)
    mcfg = models.get_preset("tiny", model_type="qwen2", vocab_size=len(tok), num_layers=1,
                             hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                             max_position_embeddings=512, tie_word_embeddings=True)
    models.save_hf(mcfg, models.init_params(mcfg, jax.random.PRNGKey(0)), str(model_dir))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = config_lib.default_config()
    config_lib.merge_into(cfg, dict(
        steps=1, checkpoint_every=0, memory=dict(check="off"),
        model=dict(path=str(model_dir)), tokenizer=dict(chat_template=True),
        data=dict(source="jsonl", path=str(data), eval_path=str(data), template="qa",
                  max_prompt_length=64),
        rollout=dict(batch_size=8, max_new_tokens=4), algo=dict(num_generations=4, beta=0.0),
        reward=dict(names=("gsm8k",)), eval=dict(num_examples=8, batch_size=8),
        logging=dict(tensorboard=False, console_every_s=0.0, num_completions_to_print=1)))
    config_lib.validate(cfg)
    workdir = root / "run"
    assert run.train(cfg, str(workdir)) == 0
    return cfg, workdir


def test_training_prints_sampled_completions(chat_run, capsys):
    cfg, workdir = chat_run
    other = str(workdir) + "_again"
    assert run.train(cfg, other) == 0
    err = capsys.readouterr().err
    assert err.count("--- prompt ---") == 1  # one step, logging.num_completions_to_print=1
    assert "<|im_start|>user\nQuestion: What is" in err and "--- completion (reward " in err


def test_sample_uses_the_run_templates_and_separates_the_completion(chat_run, capsys):
    _, workdir = chat_run
    assert cli.main(["sample", "--workdir", str(workdir), "--prompt", "What is 2 plus 3?"]) == 0
    out = capsys.readouterr().out
    prompt = ("<|im_start|>user\nQuestion: What is 2 plus 3?\nAnswer:<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert out.startswith(f"--- prompt ---\n{prompt}\n--- completion ---\n"), out
    assert cli.main(["sample", "--workdir", str(workdir), "--prompt", "2 plus 3", "--raw"]) == 0
    assert capsys.readouterr().out.startswith("--- prompt ---\n2 plus 3\n--- completion ---\n")


def test_a_prompt_that_already_holds_the_data_template_is_not_templated_twice(chat_run, capsys):
    """``--prompt "Question: ...\nAnswer:"`` on a run whose data.template is ``qa``: the text
    is the filled-in template, used once (the chat template still wraps it), with one line
    saying so; a plain question is still templated, without that line."""
    _, workdir = chat_run
    assert cli.main(["sample", "--workdir", str(workdir), "--prompt",
                     "Question: What is 2 plus 3?\nAnswer:", "--prompt", "What is 1 plus 1?"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("Question: ") == 2, captured.out
    assert ("<|im_start|>user\nQuestion: What is 2 plus 3?\nAnswer:<|im_end|>\n"
            "<|im_start|>assistant\n") in captured.out
    assert "<|im_start|>user\nQuestion: What is 1 plus 1?\nAnswer:<|im_end|>" in captured.out
    lines = [ln for ln in captured.err.splitlines() if "already holds data.template" in ln]
    assert len(lines) == 1 and lines[0].startswith("rljax: prompt 1 already holds"), captured.err


def test_export_is_a_complete_hf_directory(chat_run, tmp_path):
    from transformers import AutoTokenizer

    cfg, workdir = chat_run
    out = tmp_path / "hf"
    assert cli.main(["export", "--workdir", str(workdir), "--out", str(out)]) == 0
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ctx = build_context(cfg, str(workdir))
    for ex in eval_examples(ctx)[:4]:  # the prompts the run trained and evaluated on
        ids = ctx.tokenizer.encode(ex["prompt"])
        assert hf.encode(ex["prompt"], add_special_tokens=False) == ids
        chat = hf.apply_chat_template([{"role": "user", "content": f"Question: {ex['question']}"
                                        "\nAnswer:"}], add_generation_prompt=True,
                                      tokenize=False)
        assert hf.encode(chat, add_special_tokens=False) == ids
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    loaded_cfg, _ = models.load_hf(str(out))
    assert loaded_cfg.num_layers == 1


def test_export_refuses_non_empty_out_and_run_directories(chat_run, tmp_path, capsys):
    _, workdir = chat_run
    config_before = (workdir / "config.json").read_bytes()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def export(*extra):
        code = cli.main(["export", "--workdir", str(workdir), "--out", *extra])
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rljax: error")]
        return code, err[0] if err else ""

    code, err = export(str(out))
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert os.listdir(out) == ["notes.txt"]
    assert export(str(out), "--overwrite") == (0, "")
    assert (out / "model.safetensors").exists() or any(out.glob("*.safetensors"))
    # The workdir itself, a directory inside it, or another run: never, even with --overwrite.
    for target in (workdir, workdir / "checkpoints", workdir / "hf"):
        code, err = export(str(target), "--overwrite")
        assert code == 2 and "run directory" in err, err
    assert not (workdir / "hf").exists()
    assert (workdir / "config.json").read_bytes() == config_before
    other_run = tmp_path / "other"
    other_run.mkdir()
    (other_run / "config.json").write_text(config_lib.to_json(config_lib.default_config()))
    code, err = export(str(other_run), "--overwrite")
    assert code == 2 and "rljax run directory" in err
    # The workdir still works.
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
