"""A process reward model (PRM) against an outcome reward model (ORM) of the same size, on the
built-in multi-step arithmetic task (CPU, tiny llama).

Both are ``rljax train`` runs of ``configs/prm_arithmetic_steps.py`` with the same seed, so they
start from the same SFT warm-up (the policy, and the trunk both heads sit on):

* ``prm``: the config as it is: Math-Shepherd step labels sampled from the policy;
* ``orm``: ``algo.name=rm``: the Bradley-Terry reward model on (reference solution, the same
  solution with a wrong final result) pairs, as many pairs per update as the PRM has labelled
  solutions, as many updates (completions padded to 24 tokens: a wrong result can be longer).

Then both score the same held-out material (eval problems the training never drew):

* ``steps``: every eval problem as its reference solution and a copy with one wrong step (later
  steps carry the wrong value on), in the policy's own format. Step AUROC: the score at each
  step's last token against "this step and the ones before it are right"; solution AUROC: the
  PRM's weakest step (``min``) and the ORM's score after the whole solution (``last``) against
  "the solution is right".
* ``samples``: N completions per eval problem sampled from the warmed-up policy at temperature
  1, verified; AUROC of each scorer's solution score against correctness, the fraction of
  (right, wrong) pairs of one problem ranked right (``pair_accuracy``), and best-of-N accuracy.

    python bench/prm_vs_orm.py --seed 0 --out bench/results/prm_vs_orm.json

Prints the JSON it writes (runs under ``--workdir``, default /tmp/prm_vs_orm).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = "configs/prm_arithmetic_steps.py"


def train(workdir: str, overrides: list[str]) -> dict:
    """One ``rljax train`` run (skipped when ``workdir`` already finished); its last eval
    record and the CPU seconds it took (children's rusage)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        cmd = [sys.executable, "-m", "rljax.cli", "train", "--config", CONFIG, "--workdir",
               workdir, *[f"--config.{o}" for o in overrides]]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    return {"overrides": overrides, "wall_s": round(time.time() - t0, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "last_eval": evals[-1] if evals else {}}


def load(workdir: str, overrides: list[str]):
    """(ctx, state) of a finished run's latest checkpoint."""
    from rljax import config as config_lib
    from rljax.train import inference

    cfg = config_lib.load_config(os.path.join(ROOT, CONFIG), overrides)
    ctx, state, _ = inference.load_for_inference(cfg, workdir)
    return ctx, state


def evaluate(prm_dir, prm_over, orm_dir, orm_over, n: int, seed: int) -> dict:
    import jax

    from rljax.models import lora as lora_lib
    from rljax.train.core import evaluate as eval_lib
    from rljax.train.methods import prm_rerank
    from rljax.train.phases import prm

    ctx, prm_state = load(prm_dir, prm_over)
    orm_ctx, orm_state = load(orm_dir, orm_over)
    fns = {name: prm_rerank.value_logits_fn(c.model_cfg,
                                             lora_lib.value_on_base(s.params, s.critic_params))
           for name, c, s in (("prm", ctx, prm_state), ("orm", orm_ctx, orm_state))}
    out = {"steps": {}}
    batches = prm.eval_batches(ctx)
    for name, mode in (("prm", "min"), ("orm", "last"), ("prm_last", "last")):
        m = prm.eval_metrics(fns[name.split("_")[0]], batches, mode)
        out["steps"][name] = {k.split("/", 1)[1]: v for k, v in m.items()
                              if k in ("eval/step_auroc", "eval/solution_auroc", "eval/steps")}
    examples = eval_lib.eval_examples(ctx)
    rng = jax.random.fold_in(jax.random.key(seed), 7)
    scorers = {"prm": (fns["prm"], "min"), "prm_last": (fns["prm"], "last"),
               "orm": (fns["orm"], "last")}
    out["samples"] = prm_rerank.best_of_n(ctx, prm_state.params, scorers, examples, rng, n=n,
                                          temperature=1.0, prompts_per_batch=25)
    out["samples"]["seconds"] = round(out["samples"]["seconds"], 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=8, help="samples per problem (best-of-N)")
    ap.add_argument("--workdir", default="/tmp/prm_vs_orm")
    ap.add_argument("--out", default="")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for both runs")
    args = ap.parse_args()
    from rljax import config as config_lib
    base = config_lib.load_config(os.path.join(ROOT, CONFIG), [])
    rows = 2 * (base.rollout.batch_size // base.algo.num_generations)
    common = [f"seed={args.seed}", *args.extra]
    prm_over = common
    # rollout.max_new_tokens only pads the ORM's pairs: a wrong result can be longer than the
    # solution (each occurrence of the answer replaced); the warm-up does not read it.
    orm_over = common + ["algo.name=rm", "algo.num_generations=1",
                         f"rollout.batch_size={rows}", "rollout.max_new_tokens=24"]
    prm_dir = os.path.join(args.workdir, f"prm_s{args.seed}")
    orm_dir = os.path.join(args.workdir, f"orm_s{args.seed}")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
              platform.machine(), "load_before": os.getloadavg(), "seed": args.seed,
              "config": CONFIG, "runs": {"prm": train(prm_dir, prm_over),
                                         "orm": train(orm_dir, orm_over)}}
    result["eval"] = evaluate(prm_dir, prm_over, orm_dir, orm_over, args.n, args.seed)
    result["load_after"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
