"""Offline DPO recipe for a real Hugging Face checkpoint and a preference JSONL file.

Set the two paths (here or on the command line)::

    rljax train --config configs/dpo_hf_example.py --workdir runs/dpo_hf \\
        --config.model.path=/models/Qwen2.5-0.5B-Instruct \\
        --config.data.path=/data/prefs_train.jsonl --config.data.eval_path=/data/prefs_test.jsonl

The JSONL has one pair per line: ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (other
column names: ``--config.data.kwargs.fields='{"prompt": "question", "chosen": "good",
"rejected": "bad"}'``). Prompts are wrapped in the tokenizer's chat template
(``tokenizer.chat_template``); ``chosen`` / ``rejected`` are the assistant replies, scored
with EOS appended. Pairs longer than ``data.max_prompt_length`` / ``rollout.max_new_tokens``
tokens are skipped. The reference is the loaded checkpoint (frozen); ``eval/pref_accuracy`` on
``data.eval_path`` is the held-out preference accuracy. Export the result with
``rljax export --workdir runs/dpo_hf --out HF_DIR``.

Memory: policy + reference + Adam state is ~4x the parameters (bfloat16 params, f32 moments);
shard over more devices with ``mesh.fsdp`` and lower ``algo.micro_batch_size`` if needed.
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 500                      # optimizer steps of rollout.batch_size pairs
    c.eval_every = 100
    c.checkpoint_every = 100
    c.model = dict(path="/path/to/hf_checkpoint", dtype="bfloat16", remat=True)
    c.tokenizer = dict(chat_template=True)   # tokenizer from model.path
    c.data = dict(source="jsonl", path="/path/to/preferences.jsonl", eval_path="",
                  template="{prompt}", max_prompt_length=512)
    c.rollout = dict(batch_size=32, max_new_tokens=512)   # pairs per step, completion slot
    c.algo = dict(name="dpo", loss_type="sigmoid", beta=0.1, label_smoothing=0.0,
                  micro_batch_size=4, num_generations=1)
    c.optimizer = dict(name="adamw", learning_rate=5e-7, schedule="cosine", warmup_steps=50,
                       weight_decay=0.0, max_grad_norm=10.0)
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.eval = dict(num_examples=512, batch_size=32)
    c.logging = dict(console_every_s=30.0)
    return c
