"""Tunix GRPOLearner timing runner (JAX CPU), called by ``bench/grpo_step.py``.

Runs in its own virtual environment (``google-tunix``, ``jax``), never the project's:

    /work/peers/tunix/bin/python bench/peers/tunix_grpo.py SPEC.json

SPEC.json: see bench/peers/trl_grpo.py. The model is Tunix's own ``llama3`` module with the
shape of the HF checkpoint in ``model_dir``, loaded from the same safetensors
(``tunix.models.llama3.params.create_model_from_safe_tensors``).

One iteration = one GRPO global step of ``GRPOLearner.train``: the vanilla rollout engine
samples G completions for each of the B prompts (Tunix repeats each prompt G times), rewards,
group advantages, one policy update (AdamW) over all B*G completions. Colocated: actor, rollout
and trainer share one 1-device mesh and the same weights (no weight sync). ``beta = 0`` (no
reference model), ``num_iterations = 1`` (no old-logps pass), one mini/micro batch. The KV cache
is sized to exactly prompt + completion slots. EOS stopping is off (``eos_tokens`` = an id the
model cannot produce), so every completion is exactly N tokens; Tunix still cuts its loss mask
after a sampled tokenizer EOS, which changes no shapes or FLOPs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import jax
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.models.llama3 import model as llama_lib
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    b, g, n = len(spec["prompts"]), spec["num_generations"], spec["max_new_tokens"]
    total_steps = 1 + spec["iters"]
    char = spec["reward_char"]
    with open(os.path.join(spec["model_dir"], "config.json")) as f:
        hf = json.load(f)
    cfg = llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000))),
        norm_eps=hf["rms_norm_eps"], weight_tying=bool(hf.get("tie_word_embeddings", False)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = llama_params.create_model_from_safe_tensors(spec["model_dir"], cfg, mesh=mesh)
    tok = transformers.AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)

    def reward_fn(prompts, completions, **kwargs):
        return [c.count(char) / max(len(c), 1) for c in completions]

    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(spec["learning_rate"], weight_decay=0.0))
    prompt_len = spec["prompt_tokens"]
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**6, max_steps=total_steps,
            mini_batch_size=b, train_micro_batch_size=b, pbar_description=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=n, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + n, temperature=1.0, top_p=1.0, top_k=None,
            eos_tokens=[hf["vocab_size"]]),  # an id the model cannot produce: exactly N tokens
    )
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tok,
                                       cluster_config=cluster_config)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward_fn,
        algo_config=grpo_learner.GRPOConfig(num_generations=g, num_iterations=1, beta=0.0,
                                            epsilon=0.2, loss_agg_mode="token-mean"))

    ends: list[float] = []
    gen_times: list[float] = []
    shapes: dict = {}
    inner_gen, inner_update = cluster.generate, cluster.update_actor

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = inner_gen(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        shapes["prompt_tokens"] = list(out.left_padded_prompt_tokens.shape)
        shapes["completion_lengths"] = sorted({len(t) for t in out.tokens})
        return out

    def timed_update(*a, **kw):
        out = inner_update(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        ends.append(time.perf_counter())
        return out

    cluster.generate, cluster.update_actor = timed_generate, timed_update
    # A numpy array of strings is one pytree leaf (Tunix repeats leaves G times).
    dataset = [{"prompts": np.array(spec["prompts"])} for _ in range(total_steps)]
    t0 = time.perf_counter()
    learner.train(dataset)
    times = [ends[0] - t0] + [b_ - a_ for a_, b_ in zip(ends, ends[1:])]
    steady = times[1:]
    it = statistics.median(steady)
    sample = statistics.median(gen_times[1:])

    import importlib.metadata as md
    print(json.dumps({
        "framework": "tunix",
        "versions": {"google-tunix": md.version("google-tunix"), "jax": jax.__version__,
                     "flax": md.version("flax")},
        "first_iter_s": times[0], "iter_s": it, "iter_s_all": steady,
        "sample_s": sample, "update_s": it - sample, "tokens_per_s": b * g * n / it,
        "iterations": len(steady), "shapes": shapes,
        "weights": "same safetensors as the other frameworks",
    }))


if __name__ == "__main__":
    main(sys.argv[1])
