"""The GSM8K / Qwen2.5 config: validates, and runs one GRPO step end to end on a tiny random
qwen2-format checkpoint with a tiny BPE tokenizer built offline (nothing is downloaded)."""
import json
import os

import jax
import pytest

from rljax import config as config_lib
from rljax import models
from rljax.train import run
from rljax.train.core.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "grpo_gsm8k_qwen2_5.py")
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def _lines(name, n):
    with open(os.path.join(GSM8K, name)) as f:
        return [next(f) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny byte-level BPE tokenizer (trained on a few GSM8K questions) and a random qwen2
    model saved in HF format next to it."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [json.loads(line)["question"] + " " + json.loads(line)["answer"]
              for line in _lines("train.jsonl", 200)]
    raw = Tokenizer(tm.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("qwen2_tiny")
    tok.save_pretrained(out)
    cfg = models.get_preset("tiny", model_type="qwen2", vocab_size=len(tok), num_layers=1,
                            hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                            max_position_embeddings=2048, tie_word_embeddings=True)
    models.save_hf(cfg, models.init_params(cfg, jax.random.PRNGKey(0)), str(out))
    return str(out)


def test_gsm8k_config_validates():
    cfg = config_lib.load_config(CONFIG)
    assert cfg.reward.names == ("gsm8k",) and cfg.model.path and cfg.data.source == "jsonl"


def test_gsm8k_config_runs_one_step_on_a_tiny_qwen2(hf_checkpoint, tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(_lines("train.jsonl", 16)))
    test.write_text("".join(_lines("test.jsonl", 4)))
    cfg = config_lib.load_config(CONFIG, [
        f"model.path={hf_checkpoint}", "model.dtype=float32", f"data.path={train}",
        f"data.eval_path={test}", "data.max_prompt_length=1024", "steps=1",
        "rollout.batch_size=8", "rollout.max_new_tokens=8", "algo.num_generations=4",
        "algo.mini_batch_size=0", "algo.micro_batch_size=4", "eval.num_examples=4",
        "eval.batch_size=4", "eval.max_new_tokens=8", "logging.tensorboard=false"])
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=jax.devices()[:1]) == 0
    records = read_metrics(workdir)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == 1 and "reward/gsm8k/mean" in rl[0]
    assert rl[0]["rollout/logp_diff_max"] < 1e-3
    assert [r["step"] for r in records if "eval/accuracy" in r] == [1]
