"""TRL GRPOTrainer timing runner (PyTorch, CPU or CUDA), called by ``bench/grpo_step.py``.

Runs in its own virtual environment (``torch``, ``trl``), never the project's:

    /work/peers/trl/bin/python bench/peers/trl_grpo.py SPEC.json

SPEC.json (written by bench/grpo_step.py): model_dir (HF llama + tokenizer, random weights),
prompts (B strings), num_generations G, max_new_tokens N, iters (timed iterations after one
warm-up), learning_rate, seed, reward_char, threads, and optionally device ("cpu" | "cuda"),
dtype ("float32" | "bfloat16": the weights' dtype, and TRL's bf16 flag) and micro_batch
(completions per forward/backward: gradient accumulation over B*G/micro_batch chunks, one
generation of all B*G completions and one optimizer step per iteration). Prints one JSON object on the last line.

One iteration = one ``GRPOTrainer`` optimizer step: generate G completions for each of the B
prompts, score them, group advantages, one forward+backward over all B*G completions, one AdamW
update. ``per_device_train_batch_size = B*G``, ``gradient_accumulation_steps = 1``,
``steps_per_generation = 1``, ``num_iterations = 1``, ``beta = 0`` (no reference model), so
there is no separate old-logps forward pass. ``min_new_tokens = N``, so every completion is
exactly N tokens.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(int(spec.get("threads") or os.cpu_count()))
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    b, g, n = len(spec["prompts"]), spec["num_generations"], spec["max_new_tokens"]
    # Micro-batch (forward/backward chunk; one optimizer step per iteration either way).
    micro = int(spec.get("micro_batch") or b * g)
    total_steps = 1 + spec["iters"]
    char = spec["reward_char"]

    def reward_fn(prompts, completions, **kwargs):
        return [c.count(char) / max(len(c), 1) for c in completions]

    times: list[float] = []
    gen_times: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now

    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, spec.get("dtype", "float32"))
    on_cpu = spec.get("device", "cpu") == "cpu"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype,
                                                 local_files_only=True)
    ds = datasets.Dataset.from_dict({"prompt": list(spec["prompts"]) * total_steps})
    with tempfile.TemporaryDirectory() as out:
        cfg = trl.GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=10**6,
            disable_tqdm=True, use_cpu=on_cpu, seed=spec["seed"], max_steps=total_steps,
            per_device_train_batch_size=micro, gradient_accumulation_steps=b * g // micro,
            steps_per_generation=b * g // micro, num_generations=g, num_iterations=1,
            max_completion_length=n, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", shuffle_dataset=False,
            loss_type="dapo", bf16=dtype == torch.bfloat16, fp16=False, dataloader_num_workers=0,
            generation_kwargs={"min_new_tokens": n},
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=ds,
                                  processing_class=tok, callbacks=[Clock()])
        # Sampling phase (generation + reward + advantages): wrap the trainer's own method.
        inner = trainer._generate_and_score_completions

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out_ = inner(*a, **kw)
            gen_times.append(time.perf_counter() - t0)
            return out_

        trainer._generate_and_score_completions = timed
        trainer.train()

    steady, steady_gen = times[1:], gen_times[1:]
    it = statistics.median(steady)
    print(json.dumps({
        "framework": "trl",
        "versions": {"trl": trl.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "threads": torch.get_num_threads(), "device": str(model.device),
        "first_iter_s": times[0], "iter_s": it, "iter_s_all": steady,
        "sample_s": statistics.median(steady_gen), "update_s": it - statistics.median(steady_gen),
        "tokens_per_s": b * g * n / it, "iterations": len(steady),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
