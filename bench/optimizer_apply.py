"""The optimizer apply alone: ``optim.apply_if_finite`` now vs the session-8 form.

    python bench/optimizer_apply.py [--shape real|toy] [--runs 7]

AdamW + clipping from the default config, jitted with params and state donated, on
SmolLM2-135M's shape (random weights) or the 4L-128 toy. "before" is the earlier form:
the update, then ``jnp.where(ok, new, old)`` over params and state, with an ``isfinite`` pass
per leaf and optax's clip (its own norm). Prints the median wall time per apply, XLA's
temporary memory, the number of copy instructions in the compiled program and whether both
give the same parameters.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import update_step  # noqa: E402  (the model shapes)
from rljax import compilation_cache, config as config_lib, models  # noqa: E402
from rljax.train.core import optim  # noqa: E402


def before(optimizer):
    def apply(params, opt_state, grads, loss):
        ok = jnp.isfinite(loss) & optim.all_finite(grads)
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state)
    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(update_step.SHAPES), default="real")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    cfg = models.get_preset("tiny", **update_step.SHAPES[args.shape][0])
    params = models.init_params(cfg, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    opt_cfg = config_lib.default_config().optimizer
    old_opt_cfg = opt_cfg.copy_and_resolve_references()
    old_opt_cfg.max_grad_norm = 0.0   # optax's clip goes in front by hand below
    old_tx = optax.chain(optax.clip_by_global_norm(float(opt_cfg.max_grad_norm)),
                         optim.make_optimizer(old_opt_cfg, 100))
    new_tx = optim.make_optimizer(opt_cfg, 100)
    forms = {"before": (old_tx, before(old_tx)),
             "now": (new_tx, lambda p, s, g, l: optim.apply_if_finite(new_tx, p, s, g, l)[:2])}
    options = compilation_cache.training_compiler_options()
    loss = jnp.float32(1.0)
    results = {}
    for name, (tx, fn) in forms.items():
        step = jax.jit(fn, donate_argnums=(0, 1), compiler_options=options)
        p, s = jax.tree.map(jnp.copy, params), tx.init(params)
        compiled = step.lower(p, s, grads, loss).compile()
        copies = len(re.findall(r"= \S+ copy\(", compiled.as_text()))
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
        p, s = compiled(p, s, grads, loss)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            p, s = compiled(p, s, grads, loss)
            jax.block_until_ready(p)
            times.append(time.perf_counter() - t0)
        results[name] = p
        print(f"{name:6s}: {statistics.median(times) * 1e3:8.1f} ms per apply, temp {temp:7.1f} "
              f"MiB, {copies} copies")
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(results["before"]),
                                                    jax.tree.leaves(results["now"])))
    print(f"{args.shape}: same parameters after {args.runs + 1} applies: {same}; load "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
