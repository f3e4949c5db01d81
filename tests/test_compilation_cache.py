"""The persistent compilation cache: a second process compiles nothing that the first did."""
import json
import os
import subprocess
import sys

import pytest

from rljax import compilation_cache, config as config_lib
from rljax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Counts the persistent cache's misses (programs XLA had to compile) and hits (executables
# loaded from disk) for a small jitted program, through jax.monitoring's events.
PROGRAM = r"""
import json, sys
import jax, jax.numpy as jnp
from rljax import compilation_cache
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
compilation_cache.enable(sys.argv[1])
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8)))
print(json.dumps({"misses": events.count("/jax/compilation_cache/cache_misses"),
                  "hits": events.count("/jax/compilation_cache/cache_hits"), "y": float(y)}))
"""


def _run(cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", PROGRAM, cache_dir], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_instead_of_compiling(tmp_path):
    cache = str(tmp_path / "cache")
    first, second = _run(cache), _run(cache)
    assert first["misses"] >= 1 and first["hits"] == 0 and os.listdir(cache)
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert second["y"] == first["y"]


def test_cache_dir_setting(monkeypatch, tmp_path):
    assert compilation_cache.resolve_dir("") is None
    assert compilation_cache.resolve_dir("/x/y") == "/x/y"
    monkeypatch.setenv("RLJAX_CACHE_DIR", str(tmp_path))
    assert compilation_cache.resolve_dir("auto") == str(tmp_path / "jax")
    monkeypatch.delenv("RLJAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.resolve_dir("auto") == str(tmp_path / "xdg" / "rljax" / "jax")


def test_compile_for_picks_the_cpu_options(monkeypatch):
    """``compile_for="startup"`` adds XLA:CPU's older fusion emitters to the sampler's and the
    training programs' options; "throughput" leaves the sampler on the defaults."""
    monkeypatch.setenv("XLA_FLAGS", "")   # the suite's own flags would win (next test)
    monkeypatch.setattr(compilation_cache, "_compile_for", "throughput")
    assert compilation_cache.sampler_compiler_options() is None
    assert compilation_cache.training_compiler_options() == {"xla_backend_optimization_level": 1}
    cfg = config_lib.default_config()
    cfg.compile_for, cfg.compilation_cache_dir = "startup", ""
    assert compilation_cache.from_config(cfg) is None   # the cache setting is left alone
    startup = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}
    assert compilation_cache.sampler_compiler_options() == startup
    assert compilation_cache.training_compiler_options() == startup
    with pytest.raises(ValueError, match="compile_for='fast'"):
        compilation_cache.set_compile_for("fast")
    cfg.compile_for = "fast"
    with pytest.raises(ConfigError, match="compile_for='fast' is not one of: throughput, startup"):
        config_lib.validate(cfg)


def test_the_configs_compile_for_names_are_the_caches():
    from rljax.config.train import COMPILE_FOR
    assert compilation_cache.COMPILE_FOR == COMPILE_FOR


def test_an_option_set_in_xla_flags_wins_over_rljax_choice(monkeypatch):
    """A flag the user set in ``XLA_FLAGS`` is not overridden per program: only the options it
    leaves unset are passed, and none at all once it sets them all."""
    monkeypatch.setattr(compilation_cache, "_compile_for", "startup")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    "--xla_backend_optimization_level=0")
    assert compilation_cache.training_compiler_options() == {"xla_cpu_use_fusion_emitters": False}
    assert compilation_cache.elementwise_compiler_options() == {
        "xla_cpu_use_fusion_emitters": False}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                    "--xla_cpu_use_fusion_emitters=false")
    assert compilation_cache.training_compiler_options() is None
    assert compilation_cache.sampler_compiler_options() is None
