"""Greedy held-out accuracy of the Gemma 3 270M base on candidate arithmetic prompts: how the
task of configs/grpo_gemma3_270m.py was chosen (a start between 10% and 60%).

Each candidate is a task of ``rljax.data.tasks.ArithmeticTask`` and a prompt form; 100 test
problems, greedy, 8 new tokens, stop at EOS or the newline, graded by the ``arithmetic``
reward; the prompt starts with Gemma's BOS.

    python bench/gemma3_prompts.py [--n 100]
"""
import argparse
import json

import jax
import numpy as np

from rljax import models, sampling, tokenizers
from rljax.data.tasks import ArithmeticTask
from rljax.rewards.verifiers import arithmetic

TASKS = {
    "add2": dict(digits=2, operands=2, ops="+"),
    "addsub3": dict(digits=2, operands=3, ops="+-"),
    "add3d": dict(digits=3, operands=2, ops="+"),
    "add1": dict(digits=1, operands=2, ops="+"),
    "mul1": dict(digits=1, operands=2, ops="*"),
    "addsub1x3": dict(digits=1, operands=3, ops="+-"),
}


def shots(task, k):
    """k solved training-split problems, one per line."""
    return "".join(f"{e['question']}{e['answer']}\n" for e in
                   (task.example(i, "train") for i in range(k)))


PROMPTS = {   # name -> (task, prompt of a question such as "12+7=")
    "add2 4-shot": ("add2", lambda t, q: shots(t, 4) + q),
    "addsub3 4-shot": ("addsub3", lambda t, q: shots(t, 4) + q),
    "add3d 4-shot": ("add3d", lambda t, q: shots(t, 4) + q),
    "add2 zero-shot": ("add2", lambda t, q: q),
    "add2 1-shot": ("add2", lambda t, q: shots(t, 1) + q),
    "add2 2-shot": ("add2", lambda t, q: shots(t, 2) + q),
    "add2 Q/A": ("add2", lambda t, q: f"Q: {q}?\nA:"),
    "add2 Question/Answer": ("add2", lambda t, q: f"Question: What is {q}?\nAnswer:"),
    "add1 4-shot": ("add1", lambda t, q: shots(t, 4) + q),
    "add1 Question/Answer": ("add1", lambda t, q: f"Question: What is {q}?\nAnswer:"),
    "mul1 4-shot": ("mul1", lambda t, q: shots(t, 4) + q),
    "mul1 Question/Answer": ("mul1", lambda t, q: f"Question: What is {q}?\nAnswer:"),
    "addsub1x3 4-shot": ("addsub1x3", lambda t, q: shots(t, 4) + q),
    "addsub1x3 Question/Answer": ("addsub1x3",
                                  lambda t, q: f"Question: What is {q}?\nAnswer:"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=None, help="prompt names to measure (default all)")
    a = ap.parse_args()
    path = models.gemma3_270m_path()
    cfg, params = models.load_hf(path)
    tok = tokenizers.load(path)
    newline = tok.encode("\n")[0]
    for name, (task_name, prompt) in PROMPTS.items():
        if a.only and name not in a.only:
            continue
        task = ArithmeticTask(**TASKS[task_name])
        exs = [task.example(i, "test") for i in range(a.n)]
        texts = [prompt(task, e["question"]) for e in exs]
        p_tok, p_mask = sampling.pad_to_bucket([tok.encode(t, add_bos=True) for t in texts],
                                               pad_id=tok.pad_id)
        out = sampling.generate(cfg, params, p_tok, p_mask, rng=jax.random.PRNGKey(0),
                                max_new_tokens=a.max_new_tokens, temperature=0.0,
                                eos_id=(tok.eos_id, newline), pad_id=tok.pad_id)
        comps = tok.batch_decode(np.asarray(out.tokens), np.asarray(out.mask))
        score = arithmetic(texts, comps, answer=[e["answer"] for e in exs])
        print(json.dumps({"prompt": name, "max_new_tokens": a.max_new_tokens, "accuracy": float(np.mean(score)),
                          "truncated": float(np.mean(np.asarray(out.truncated))),
                          "first": texts[0][-30:] + "|" + comps[0]}), flush=True)


if __name__ == "__main__":
    main()
