"""``rollout.stop_strings``: one-token texts that end a completion like EOS (a base model's
few-shot prompts stop at a newline), and the one-line refusal of a text that is not one token."""
import jax
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.train.core import setup
from rljax.train.phases.grpo import GRPOPhase
from test_train_loop import tiny_cfg


def test_a_stop_string_ends_completions_in_rollouts(tmp_path):
    cfg = tiny_cfg(**{"sft.steps": 0, "rollout.max_new_tokens": 12, "rollout.batch_size": 32,
                      "algo.num_generations": 4, "algo.mini_batch_size": 0})
    cfg.rollout.stop_strings = ("1",)
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    stop = ctx.tokenizer.encode("1")[0]
    assert ctx.stop_ids == (ctx.tokenizer.eos_id, stop)
    rnd = GRPOPhase(ctx, 1).rollout.sample_round(ctx.params, jax.random.key(3))
    tokens, mask = np.asarray(rnd["tokens"]), np.asarray(rnd["mask"])
    lengths = mask.sum(-1)
    stopped = 0
    for row, n in zip(tokens[:, -mask.shape[1]:], lengths):
        real = list(row[:n])
        assert stop not in real[:-1]            # nothing is sampled after a stop
        stopped += real[-1] == stop and n < mask.shape[1]
    assert stopped > 0                          # the untrained model does emit "1"


def test_a_stop_string_of_several_tokens_is_refused_in_one_line(tmp_path):
    cfg = tiny_cfg(**{"sft.steps": 0})
    cfg.rollout.stop_strings = ("\n", "12")
    with pytest.raises(ConfigError, match=r"rollout.stop_strings: '12' is 2 tokens"):
        setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
