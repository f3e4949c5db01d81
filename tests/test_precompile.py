"""The GRPO update compiles in a background thread during the first rollout
(``rljax.train.precompile``): the first update call compiles nothing on the main thread, and
results are identical to compiling on first use."""
import threading

import jax
import numpy as np
import pytest
from jax._src import monitoring

from rljax import config as config_lib
from rljax.train import inference, precompile, setup
from rljax.train.phases import make_phases
from rljax.train.phases.grpo import GRPOPhase

DEVICES = jax.devices()[:1]


def tiny_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 2, "eval_every": 0, "checkpoint_every": 0, "sft.steps": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "logging.tensorboard": False, "compilation_cache_dir": "",
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


def run_phase(cfg, workdir, steps=1):
    """(final params as numpy, main-thread compiles per iteration, the phase)."""
    compiles = []   # (thread name, function name) of every XLA compilation

    def on_span(event, start, end, **kw):
        if event.endswith("backend_compile_duration"):
            compiles.append((threading.current_thread().name, kw.get("fun_name")))
    monitoring.register_event_time_span_listener(on_span)
    try:
        ctx = setup.build_context(cfg, workdir, devices=DEVICES)
        phase = make_phases(ctx)[-1]
        state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
        per_iter = []
        for step in range(steps):
            t1 = [0]
            original = phase._compiled

            def compiled(s):   # marks the end of the rollout: the update's compiles follow
                t1[0] = len(compiles)
                return original(s)
            phase._compiled = compiled
            state, _ = phase.iteration(state, step)
            del phase._compiled
            jax.block_until_ready(state.params)
            per_iter.append([c for c in compiles[t1[0]:] if c[0] == "MainThread"])
    finally:
        monitoring.unregister_event_time_span_listener(on_span)
    return jax.tree.map(np.asarray, state.params), per_iter, phase


@pytest.mark.parametrize("overrides", [
    {},                                         # shared prompts: host-planned micro-steps
    {"algo.shared_prompt": False},              # the single jitted step
    {"algo.num_iterations": 2, "algo.beta": 0.04, "algo.adv_estimator": "reinforce_pp"},
])
def test_update_compiles_in_background_and_results_are_identical(tmp_path, monkeypatch,
                                                                 overrides):
    cfg = tiny_cfg(**overrides)
    monkeypatch.setattr(GRPOPhase, "precompile", True)   # off by default
    params, per_iter, phase = run_phase(cfg, str(tmp_path / "bg"))
    assert phase._warmup is None and phase._precompiled
    # Every update program the first iteration ran came from the background compile.
    assert per_iter[0] == [], per_iter[0]
    monkeypatch.setattr(GRPOPhase, "precompile", False)
    plain, plain_iter, _ = run_phase(cfg, str(tmp_path / "plain"))
    assert plain_iter[0], "without it, the first update compiles on the main thread"
    jax.tree.map(np.testing.assert_array_equal, params, plain)


def test_batch_spec_matches_the_rollout_batch(tmp_path):
    """The predicted layout is the batch the rollout returns (keys, shapes, dtypes)."""
    for overrides in ({}, {"algo.beta": 0.04, "algo.adv_estimator": "reinforce_pp"},
                      {"rollout.temperature_schedule.name": "linear"}):
        cfg = tiny_cfg(**overrides)
        ctx = setup.build_context(cfg, str(tmp_path / "ctx"), devices=DEVICES)
        phase = make_phases(ctx)[-1]
        state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
        batch, _ = phase.rollout(state, 0)
        spec = precompile.rollout_batch_spec(phase.rollout, batch["tokens"].shape[1] - 4,
                                             cfg.rollout.batch_size)
        assert {k: (tuple(np.shape(v)), np.dtype(v.dtype)) for k, v in batch.items()} == \
            {k: (s.shape, np.dtype(s.dtype)) for k, s in spec.items()}, overrides
