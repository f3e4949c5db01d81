"""DPO family and Bradley-Terry reward-model loss against NumPy written from the papers."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms as A


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _inputs(seed=0, n=9):
    rng = np.random.default_rng(seed)
    f = lambda: (-rng.random(n) * 40).astype(np.float32)
    return f(), f(), f(), f()


def np_dpo(pc, pr, rc, rr, beta, loss_type, ls, gamma=0.0, lc=None, lr=None):
    out = []
    for i in range(len(pc)):
        a, b, c, d = (float(v[i]) for v in (pc, pr, rc, rr))
        if loss_type == "simpo":
            c = d = 0.0
        if lc is not None:
            a, c = a / lc[i], c / lc[i]
        if lr is not None:
            b, d = b / lr[i], d / lr[i]
        h = (a - c) - (b - d)
        if loss_type == "sigmoid":
            out.append(-(1 - ls) * _logsig(beta * h) - ls * _logsig(-beta * h))
        elif loss_type == "robust":
            out.append((-(1 - ls) * _logsig(beta * h) + ls * _logsig(-beta * h)) / (1 - 2 * ls))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif loss_type == "simpo":
            z = beta * h - gamma
            out.append(-(1 - ls) * _logsig(z) - ls * _logsig(-z))
    return np.array(out)


@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.1),
                                          ("robust", 0.0), ("hinge", 0.0), ("ipo", 0.0)])
def test_dpo_losses_match_numpy(loss_type, ls):
    pc, pr, rc, rr = _inputs()
    beta = 0.1
    losses, cr, rj = A.dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                                label_smoothing=ls)
    np.testing.assert_allclose(np.asarray(losses), np_dpo(pc, pr, rc, rr, beta, loss_type, ls),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cr), beta * (pc.astype(np.float64) - rc), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(rj), beta * (pr.astype(np.float64) - rr), rtol=1e-5,
                               atol=1e-6)


def test_dpo_gradient_is_the_paper_gradient():
    # d/d pi_w of -log sig(beta h) = -beta * sig(-beta h)
    pc, pr, rc, rr = _inputs(1)
    beta = 0.5
    g = jax.grad(lambda x: A.dpo_loss(x, pr, rc, rr, beta=beta)[0].sum())(jnp.asarray(pc))
    h = (pc.astype(np.float64) - rc) - (pr - rr)
    np.testing.assert_allclose(np.asarray(g), -beta / (1 + np.exp(beta * h)), rtol=1e-5,
                               atol=1e-7)
    # rewards carry no gradient
    gr = jax.grad(lambda x: A.dpo_loss(x, pr, rc, rr)[1].sum())(jnp.asarray(pc))
    assert np.all(np.asarray(gr) == 0)


def test_length_normalised_and_simpo():
    pc, pr, rc, rr = _inputs(2)
    rng = np.random.default_rng(2)
    lc = rng.integers(1, 30, size=len(pc)).astype(np.float32)
    lr = rng.integers(1, 30, size=len(pc)).astype(np.float32)
    beta, gamma = 2.0, 0.8
    losses, cr, rj = A.dpo_loss(pc, pr, None, None, beta=beta, loss_type="simpo",
                                chosen_lengths=lc, rejected_lengths=lr, simpo_gamma=gamma)
    np.testing.assert_allclose(np.asarray(losses),
                               np_dpo(pc, pr, rc, rr, beta, "simpo", 0.0, gamma, lc, lr),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cr), beta * pc / lc, rtol=1e-5)
    # reference log-probs are ignored by simpo; pre-normalised inputs give the same result
    l2, _, _ = A.dpo_loss(pc / lc, pr / lr, rc, rr, beta=beta, loss_type="simpo",
                          simpo_gamma=gamma, label_smoothing=0.0)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(losses), rtol=1e-5, atol=1e-6)
    # IPO on length-averaged log-probs
    li, _, _ = A.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo", chosen_lengths=lc,
                          rejected_lengths=lr)
    np.testing.assert_allclose(np.asarray(li), np_dpo(pc, pr, rc, rr, 0.1, "ipo", 0.0, 0, lc, lr),
                               rtol=1e-5, atol=1e-5)


def test_dpo_extreme_and_errors():
    big = jnp.array([-1e4, 0.0, -5e3])
    zero = jnp.zeros(3)
    for lt in ("sigmoid", "robust", "hinge", "ipo", "simpo"):
        ls = 0.1 if lt in ("sigmoid", "robust", "simpo") else 0.0
        f = lambda x: A.dpo_loss(x, -x, zero, zero, beta=0.1, loss_type=lt,
                                 label_smoothing=ls)[0].sum()
        assert np.isfinite(float(f(big))), lt
        assert np.all(np.isfinite(np.asarray(jax.grad(f)(big)))), lt
    with pytest.raises(ValueError, match="loss_type"):
        A.dpo_loss(zero, zero, zero, zero, loss_type="nope")
    with pytest.raises(ValueError, match="reference"):
        A.dpo_loss(zero, zero, None, None, loss_type="sigmoid")


def test_reward_model_loss_bradley_terry():
    rng = np.random.default_rng(3)
    rw = rng.normal(size=10).astype(np.float32)
    rl = rng.normal(size=10).astype(np.float32)
    margin = rng.random(10).astype(np.float32)
    mask = np.arange(10) < 7
    s, w = A.reward_model_loss(rw, rl, margin=margin, mask=mask, center_coef=0.01)
    want = sum(-_logsig(float(rw[i]) - float(rl[i]) - float(margin[i]))
               + 0.01 * (float(rw[i]) + float(rl[i])) ** 2 for i in range(7))
    np.testing.assert_allclose(float(s), want, rtol=1e-5)
    assert float(w) == 7
    s0, w0 = A.reward_model_loss(rw, rl)
    np.testing.assert_allclose(float(s0), sum(-_logsig(float(a - b)) for a, b in zip(rw, rl)),
                               rtol=1e-5)
    assert float(w0) == 10
    acc, n = A.preference_accuracy(rw, rl, mask)
    assert float(acc) == (rw > rl)[:7].sum() and float(n) == 7
    g = jax.grad(lambda x: A.reward_model_loss(x, -x)[0])(jnp.array([100.0, -100.0]))
    assert np.all(np.isfinite(np.asarray(g)))
