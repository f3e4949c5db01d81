"""GRPO on GSM8K from Qwen2.5-0.5B-Instruct (a real HF checkpoint; needs an accelerator).

Download the checkpoint yourself (rljax never downloads) and point ``model.path`` at it:

    rljax train --config configs/grpo_gsm8k_qwen2_5.py --workdir runs/gsm8k \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \\
        --config.data.path=/path/to/gsm8k/train.jsonl --config.data.eval_path=/path/to/gsm8k/test.jsonl

GSM8K JSONL lines are ``{"question": ..., "answer": "... #### 18"}``; the ``gsm8k`` reward
judges the completion's final answer against the number after ``####``.

The data is read from ``data/gsm8k/train.jsonl`` and ``data/gsm8k/test.jsonl`` under the
directory you run ``rljax`` in, or from the paths given as above. rljax ships no copy of GSM8K:
take ``train.jsonl`` / ``test.jsonl`` from the dataset's release (github.com/openai/grade-school-math,
``grade_school_math/data/``; MIT licence). With TensorFlow Datasets' ``gsm8k`` prepared in the
``array_record`` format instead, pass ``--config.data.source=tfds:gsm8k --config.data.path=
--config.data.eval_path=`` (and ``--config.data.kwargs.data_dir=DIR`` for another data dir).
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 500
    c.eval_every = 50
    c.checkpoint_every = 50
    c.model = dict(path="checkpoints/Qwen2.5-0.5B-Instruct", dtype="bfloat16", remat=True)
    c.tokenizer = dict(chat_template=True)          # tokenizer from model.path
    # GSM8K as JSONL, relative to the directory rljax runs in (data/gsm8k/ is not shipped: see
    # the docstring). Other places: --config.data.path=... --config.data.eval_path=...
    c.data = dict(source="jsonl", path="data/gsm8k/train.jsonl",
                  eval_path="data/gsm8k/test.jsonl", template="gsm8k",
                  max_prompt_length=512)
    c.rollout = dict(batch_size=256, max_new_tokens=512, temperature=1.0, top_p=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                  loss_agg_mode="token-mean", adv_estimator="grpo", mini_batch_size=64,
                  micro_batch_size=16)
    c.optimizer = dict(learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0,
                       warmup_steps=10)
    c.reward = dict(names=("gsm8k",))
    c.sft = dict(steps=0)
    c.eval = dict(num_examples=500, batch_size=128, max_new_tokens=512)
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    return c
