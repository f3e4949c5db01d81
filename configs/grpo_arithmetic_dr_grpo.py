"""Dr. GRPO (Liu et al. 2025) on the built-in arithmetic demo: no std scaling of advantages and
a constant length normaliser (``seq-mean-token-sum-norm``) instead of 1/|o_i|."""
import importlib.util
import os


def _demo():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_arithmetic.py")
    spec = importlib.util.spec_from_file_location("grpo_arithmetic", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _demo()
    c.algo.adv_estimator = "dr_grpo"
    c.algo.loss_agg_mode = "seq-mean-token-sum-norm"
    return c
