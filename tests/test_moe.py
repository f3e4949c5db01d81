"""Mixture-of-experts families (qwen3_moe, olmoe): parity with transformers on tiny random
checkpoints (logits, greedy decoding), export round trip, dropless dispatch vs a dense
reference, routing replay, load-balancing loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.models import moe, moe_dispatch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_models import _hf_logits   # noqa: E402  (transformers' logits at our positions)

FAMILIES = ("qwen3_moe", "olmoe")
B, T = 3, 12
PADS = (0, 3, 5)


def _hf_config(family):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  attn_implementation="eager", tie_word_embeddings=False)
    if family == "qwen3_moe":
        # head_dim 16 != hidden/heads = 8; renormalised top-k weights
        return transformers.Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True,
                                           rms_norm_eps=1e-6)
    return transformers.OlmoeConfig(**common, rms_norm_eps=1e-5, pad_token_id=0,
                                    eos_token_id=1)


def _randomise(model):
    """Weights large enough that logits are O(1), the router's choices are clear-cut, and
    every norm matters."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.2 * noise + 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(1.0 * noise)
            else:
                p.copy_(0.15 * noise)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 128, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    for i, pad in enumerate(PADS):
        mask[i, :pad] = False
        tokens[i, :pad] = 0
    return tokens, mask


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """family -> (checkpoint dir, HF model, HF logits on the left-padded batch)."""
    root = tmp_path_factory.mktemp("hf_moe")
    tokens, mask = _batch()
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).float().eval()
        _randomise(model)
        path = str(root / family)
        model.save_pretrained(path)
        out[family] = (path, model, _hf_logits(model, tokens, mask))
    return out


@pytest.fixture(scope="module")
def loaded(ckpts):
    return {f: models.load_hf(ckpts[f][0], dtype=jnp.float32) for f in FAMILIES}


_fwd = jax.jit(models.forward, static_argnums=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_transformers(family, ckpts, loaded):
    tokens, mask = _batch()
    cfg, params = loaded[family]
    assert cfg.model_type == family and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (family == "qwen3_moe")
    assert cfg.qk_norm_scope == ("projection" if family == "olmoe" else "head")
    ours = np.asarray(_fwd(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = ckpts[family][2]
    diff = np.abs(ours - ref)[mask].max()
    scale = np.abs(ref[mask]).max()
    print(f"{family}: max|dlogit| = {diff:.2e} (max|logit| {scale:.2f}, rel {diff / scale:.1e})")
    assert scale > 0.5
    assert diff / scale <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_matches_transformers(family, ckpts, loaded):
    cfg, params = loaded[family]
    prompt = np.array([[5, 17, 42, 9, 77, 3]], np.int32)
    n = 10
    with torch.no_grad():
        ref = ckpts[family][1].generate(torch.tensor(prompt, dtype=torch.long), do_sample=False,
                                        max_new_tokens=n, min_new_tokens=n,
                                        pad_token_id=0)[0, prompt.shape[1]:].numpy()
    out = sampling.generate(cfg, params, jnp.asarray(prompt), jnp.ones(prompt.shape, bool),
                            rng=jax.random.PRNGKey(0), max_new_tokens=n, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(family, ckpts, loaded, tmp_path):
    cfg, params = loaded[family]
    models.save_hf(cfg, params, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager").float().eval()
    tokens, mask = _batch()
    diff = np.abs(_hf_logits(model, tokens, mask) - ckpts[family][2])[mask].max()
    assert diff <= 1e-5
    cfg2, params2 = models.load_hf(str(tmp_path))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def _dense_reference(p, x, ids, weights):
    """Every expert on every token, then the chosen ones weighted: sum_j w_j * expert_{id_j}(x)."""
    g = jnp.einsum("nd,edf->enf", x, p["expert_gate"])
    u = jnp.einsum("nd,edf->enf", x, p["expert_up"])
    y = jnp.einsum("enf,efd->end", jax.nn.silu(g) * u, p["expert_down"])   # [E, N, D]
    picked = y[ids, jnp.arange(x.shape[0])[:, None]]                        # [N, k, D]
    return jnp.sum(picked * weights[..., None], axis=1)


def test_grouped_dispatch_equals_dense_reference_with_gradients():
    cfg = models.get_preset("tiny", model_type="qwen3_moe", num_experts=6,
                            num_experts_per_tok=3, moe_intermediate_size=8)
    layers = models.init_params(cfg, jax.random.PRNGKey(1))["layers"]
    p = {k: layers[k][0] for k in ("router", "expert_gate", "expert_up", "expert_down")}
    x = jax.random.normal(jax.random.PRNGKey(2), (40, cfg.hidden_size))
    ids, w, _ = moe.route(cfg, p["router"] * 50, x)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)   # norm_topk_prob
    assert len(np.unique(np.asarray(ids))) == 6   # every expert gets work

    def loss(f, p):
        return jnp.sum(jnp.sin(f(p, x, ids, w)))
    dispatch = lambda p, x, ids, w: moe_dispatch.dispatch(p, x, ids, w)[0]   # no mesh
    np.testing.assert_allclose(dispatch(p, x, ids, w),
                               _dense_reference(p, x, ids, w), rtol=1e-5, atol=1e-7)
    g1 = jax.grad(lambda p: loss(dispatch, p))(p)
    g2 = jax.grad(lambda p: loss(_dense_reference, p))(p)
    for k in ("expert_gate", "expert_up", "expert_down"):
        np.testing.assert_allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7)


def test_routing_replay_and_load_balance(ckpts, loaded):
    cfg, params = loaded["qwen3_moe"]
    tokens, mask = _batch()
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    hidden, _, stats = models.trunk(cfg, params, tokens, mask, with_moe_stats=True)
    assert stats["ids"].shape == (cfg.num_layers, B, T, cfg.num_experts_per_tok)
    # Replaying the model's own routes is the same forward.
    replayed, _ = models.trunk(cfg, params, tokens, mask, routes=stats["ids"])
    np.testing.assert_array_equal(replayed, hidden)
    # Other routes change the output, and the router still gets a gradient.
    other = (stats["ids"] + 1) % cfg.num_experts
    changed, _ = models.trunk(cfg, params, tokens, mask, routes=other)
    assert np.abs(np.asarray(changed - hidden)).max() > 1e-3
    grad = jax.grad(lambda p: jnp.sum(models.trunk(cfg, p, tokens, mask, routes=other)[0]))(
        params)
    assert np.abs(np.asarray(grad["layers"]["router"])).max() > 0
    # Load balance as transformers computes it (its aux_loss, over real tokens only).
    loss, fractions = moe.load_balance(cfg, stats)
    pos = np.maximum(np.cumsum(np.asarray(mask), axis=-1) - 1, 0)
    with torch.no_grad():
        ref = ckpts["qwen3_moe"][1](input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
                                    attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
                                    position_ids=torch.tensor(pos, dtype=torch.long),
                                    output_router_logits=True).aux_loss
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    np.testing.assert_allclose(float(fractions.sum()), 1.0, rtol=1e-6)
    assert float(loss) > cfg.num_experts_per_tok   # random routing is not perfectly balanced


def test_bad_configs_refused(ckpts, tmp_path):
    import json
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(ckpts["qwen3_moe"][0], path)
    hf = json.loads((path / "config.json").read_text())
    hf["decoder_sparse_step"] = 2
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(models.HFCheckpointError, match="every layer must be a mixture"):
        models.load_hf(str(path))
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        models.get_preset("tiny", model_type="olmoe", num_experts=8, num_experts_per_tok=9,
                          moe_intermediate_size=8)


# PPO on tool-agent episodes, each row's prompt computed by itself (algo.shared_prompt=false):
# the episodes' routes replayed by the policy's passes (the critic routes freely). Nothing is
# carried across iterations, so no resume check beyond PPO's own.
PPO_EPISODES = {"algo.name": "ppo", "algo.adv_estimator": "gae", "env.name": "tool",
                "env.tools": ("calculator",), "env.tool_format": "plain", "env.max_turns": 2,
                "env.max_total_tokens": 8, "env.max_obs_tokens": 4, "rollout.max_new_tokens": 8}


@pytest.mark.parametrize("replay,shared,asynchronous,engine,extra", [
    (False, True, False, "static", {}), (True, True, False, "static", {}),
    (True, True, True, "static", {}), (True, True, False, "slots", {}),
    (True, False, False, "static", PPO_EPISODES)])
def test_grpo_trains_a_tiny_moe_with_the_load_balancing_loss(tmp_path, replay, shared,
                                                              asynchronous, engine, extra):
    from rljax import config as config_lib
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 2, "eval_every": 0, "checkpoint_every": 0, "model.preset": "tiny-moe",
        "tokenizer.kind": "char", "data.source": "arithmetic", "data.max_prompt_length": 8,
        "rollout.batch_size": 8, "rollout.max_new_tokens": 4, "algo.num_generations": 4,
        "algo.beta": 0.0, "algo.moe_aux_loss_coef": 0.01, "optimizer.learning_rate": 1e-3,
        "eval.num_examples": 8, "eval.batch_size": 8, "logging.tensorboard": False,
        "checkpoint.async_save": False, "memory.check": "off"})
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "num_heads": 2,
                           "num_kv_heads": 1, "moe_intermediate_size": 16}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    if replay:   # routes recorded by the sampler, replayed by the old-logps pass and update
        cfg.update_from_flattened_dict({"algo.routing_replay": True,
                                        "algo.shared_prompt": shared,
                                        "algo.mini_batch_size": 4,
                                        # batches sampled a version ahead keep their routes
                                        "algo.asynchronous": asynchronous,
                                        # the slot engine records routes too
                                        "rollout.engine": engine, "rollout.slots": 4,
                                        **extra})
    if extra:
        cfg.env.kwargs = {"describe_tools": False}
    cfg = config_lib.validate(cfg)
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2
    if extra:   # PPO (no load-balancing loss): the old-logps pass replays the episodes' routes
        assert all(r["env/turns_mean"] >= 1 and np.isfinite(r["vf_loss"]) and
                   r["rollout/logp_diff_max"] < 1e-4 for r in rl)
    if asynchronous:   # stopped with batch 2 (and its routes) in flight: the same run
        from test_train_loop import StopAfter, comparable, final_params
        cfg.checkpoint_every, resumed = 1, str(tmp_path / "resumed")
        assert run.train(cfg, resumed, devices=jax.devices()[:1], stop=StopAfter(1)) == 0
        assert run.train(cfg, resumed, devices=jax.devices()[:1]) == 0
        assert comparable(read_metrics(resumed)) == comparable(read_metrics(str(tmp_path)))
        jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                     final_params(str(tmp_path)))
    for r in ([] if extra else rl):
        fractions = [r[f"moe/expert_frac/{e}"] for e in range(8)]
        np.testing.assert_allclose(sum(fractions), 1.0, rtol=1e-5)
    # Asynchronous: batch 1 was drawn by version 0 and trains under version 1, whose router
    # would choose other experts; the first batch is drawn and trained by version 0.
    for r in (rl[:1] if asynchronous else [] if extra else rl):
        # k when perfectly balanced, more otherwise (routes the router's own choice)
        assert r["moe/load_balance"] >= 2.0 - 1e-4
        assert r["rollout/logp_diff_max"] < 1e-4


def test_shared_prompt_layout_matches_the_plain_forward(loaded):
    cfg, params = loaded["olmoe"]
    rng = np.random.default_rng(1)
    g, n = 2, 5
    prompt, pmask = _batch()
    comp = rng.integers(2, 128, size=(B * g, n)).astype(np.int32)
    cmask = np.ones((B * g, n), bool)
    cmask[1, 3:] = False
    sink = {}
    shared, _ = models.shared_prompt.completion_logps(
        cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp),
        jnp.asarray(cmask), moe_stats=sink)
    full = np.concatenate([np.repeat(prompt, g, 0), comp], 1)
    fmask = np.concatenate([np.repeat(pmask, g, 0), cmask], 1)
    plain, _ = models.token_logps(cfg, params, jnp.asarray(full), jnp.asarray(fmask),
                                  first_scored=T)
    np.testing.assert_allclose(shared, np.asarray(plain)[:, T:], atol=2e-5)
    # Each prompt's tokens counted once, each completion's real tokens once.
    assert float(sink["stats"]["tokens"][0]) == pmask.sum() + cmask.sum()


def test_shared_prompt_layout_replays_the_given_routes(loaded):
    """Routing replay in the shared-prompt layout: each prompt's routes given once, each
    completion's per row, equal to the plain forward replaying the same routes row by row. The
    routes are random (not the router's choice), so a forward that ignored them would differ."""
    cfg, params = loaded["olmoe"]
    rng = np.random.default_rng(2)
    g, n, L, k = 2, 5, cfg.num_layers, cfg.num_experts_per_tok
    prompt, pmask = _batch()
    comp = rng.integers(2, 128, size=(B * g, n)).astype(np.int32)
    cmask = np.ones((B * g, n), bool)
    experts = lambda *shape: np.argsort(rng.random(shape + (cfg.num_experts,)), -1)[..., :k]
    prompt_routes = experts(L, B, T).astype(np.int32)              # [L, B, P, k]
    routes = experts(L, B * g, n).astype(np.int32)                 # [L, R, N, k]
    shared, _ = models.shared_prompt.completion_logps(
        cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp),
        jnp.asarray(cmask), routes=jnp.asarray(routes), prompt_routes=jnp.asarray(prompt_routes))
    full = np.concatenate([np.repeat(prompt, g, 0), comp], 1)
    fmask = np.concatenate([np.repeat(pmask, g, 0), cmask], 1)
    full_routes = np.concatenate([np.repeat(prompt_routes, g, 1), routes], 2)
    plain, _ = models.token_logps(cfg, params, jnp.asarray(full), jnp.asarray(fmask),
                                  first_scored=T, routes=jnp.asarray(full_routes))
    np.testing.assert_allclose(shared, np.asarray(plain)[:, T:], atol=2e-5)
    routed, _ = models.shared_prompt.completion_logps(
        cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp),
        jnp.asarray(cmask))
    assert np.abs(np.asarray(routed) - np.asarray(shared)).max() > 1e-3   # the routes mattered


def test_shared_layout_keeps_a_groups_routes_once():
    from rljax.train.core import length_groups
    g, p, n, L, k = 2, 3, 2, 1, 2
    tokens = np.array([[0, 5, 6, 7, 8], [0, 5, 6, 9, 9]], np.int32)
    mask = np.array([[False, True, True, True, True]] * 2)
    routes = np.arange(2 * (p + n) * L * k, dtype=np.int32).reshape(2, p + n, L, k)
    routes[1, :p] = routes[0, :p]                          # one prefill: the same prompt routes
    routes[1, 0] = 99                                      # (a padded column may differ)
    part = {"tokens": tokens, "mask": mask, "routes": routes}
    out = length_groups.shared_layout(part, n, g)
    np.testing.assert_array_equal(out["prompt_routes"][0, 1:], routes[0, 1:p])
    np.testing.assert_array_equal(out["routes"], routes[:, p:])
    routes[1, 2] = 42                                      # rows disagree on a real column:
    assert length_groups.shared_layout(part, n, g) is None  # each row computes its own prompt


@pytest.mark.parametrize("tree", [False, True, "slots"])
def test_sampler_records_the_routes_the_update_replays(loaded, tree):
    """The static sampler, or the tree sampler (a shared first segment forked into 2 leaves,
    each leaf carrying its prefix's routes), static or on the slot engine (each level's
    requests prefill the path so far: a leaf's routes are its last level's)."""
    cfg, params = loaded["olmoe"]
    prompt, pmask = _batch()
    opts = dict(rng=jax.random.PRNGKey(3), max_new_tokens=6, temperature=1.0, record_routes=True)
    if tree == "slots":
        out, _ = sampling.tree_engine.generate(cfg, params, prompt, pmask, segment_tokens=3,
                                               branching=2, depth=1, slots=4, chunk_steps=2,
                                               **opts)
        out = jax.tree.map(jnp.asarray, out)
    elif tree:
        out = sampling.tree.generate(cfg, params, jnp.asarray(prompt), jnp.asarray(pmask),
                                     segment_tokens=3, branching=2, depth=1, **opts)
    else:
        out = sampling.generate(cfg, params, jnp.asarray(prompt), jnp.asarray(pmask),
                                num_samples=2, **opts)
    n = out.tokens.shape[1]
    assert out.routes.shape == (B * 2, T + n, cfg.num_layers, cfg.num_experts_per_tok)
    tokens = np.concatenate([np.repeat(prompt, 2, 0), np.asarray(out.tokens)], 1)
    mask = np.concatenate([np.repeat(pmask, 2, 0), np.asarray(out.mask)], 1)
    _, _, stats = models.trunk(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                               with_moe_stats=True)
    own = np.asarray(stats["ids"]).transpose(1, 2, 0, 3)          # [R, P+N, L, k]
    fed = mask.copy()
    fed[np.arange(len(fed)), T + np.asarray(out.lengths) - 1] = False   # never fed back
    # In float32 the sampler routes every fed token as the full forward does (sets of k).
    np.testing.assert_array_equal(np.sort(np.asarray(out.routes)[fed], -1), np.sort(own[fed], -1))
    routes = jnp.transpose(out.routes, (2, 0, 1, 3))
    replayed, _ = models.token_logps(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                                     first_scored=T, routes=routes)
    np.testing.assert_allclose(np.asarray(replayed)[:, T:][np.asarray(out.mask)],
                               np.asarray(out.logps)[np.asarray(out.mask)], atol=2e-5)
    with pytest.raises(ValueError, match="record_routes needs a mixture-of-experts"):
        sampling.generate(models.get_preset("tiny"), None, jnp.asarray(prompt),
                          jnp.asarray(pmask), rng=jax.random.PRNGKey(0), max_new_tokens=2,
                          record_routes=True)


def test_routing_replay_refusals():
    from rljax import config as config_lib
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"algo.routing_replay": True, "rollout.engine": "slots",
                                    "rollout.partial": True})
    with pytest.raises(config_lib.ConfigError,
                       match="routing_replay=true is not supported with rollout.partial=true"
                       ) as refused:
        config_lib.validate(cfg)
    assert "shared_prompt" not in str(refused.value)   # the default layout replays routes too
    cfg.rollout.partial = False
    assert config_lib.validate(cfg).algo.shared_prompt   # the default layout is accepted
    cfg.rollout.tree.enabled = True   # both tree samplers record routes
    config_lib.validate(cfg)
    cfg.algo.update({"asynchronous": True, "inflight_updates": True})   # (no meaning)
    with pytest.raises(config_lib.ConfigError, match="tree sampling on rollout.engine='slots' "
                                                     "with algo.inflight_updates"):
        config_lib.validate(cfg)
    cfg.algo.update({"asynchronous": False, "inflight_updates": False})
    cfg.rollout.update({"engine": "slots", "tree": {"enabled": False}})
    cfg.env.update({"name": "tictactoe", "selfplay": {"mode": "self"}})   # matches record too
    config_lib.validate(cfg)


def test_lora_on_a_moe_covers_attention_only():
    cfg = models.get_preset("tiny-moe")
    with pytest.raises(ValueError, match="covers attention only.*'gate'"):
        models.lora.lora_shapes(cfg, 4, "q|gate")
    assert set(models.lora.lora_shapes(cfg, 4, "q|v")["layers"]) == {"q", "v"}


def test_the_moe_demo_config_has_the_dense_demos_active_mlp():
    import os
    from rljax import config as config_lib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    moe_cfg = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic_moe.py"))
    dense = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic.py"))
    m = models.get_preset(moe_cfg.model.preset, **moe_cfg.model.overrides)
    d = models.get_preset(dense.model.preset, **dense.model.overrides)
    assert m.num_experts_per_tok * m.moe_intermediate_size == d.intermediate_size
    assert m.hidden_size == d.hidden_size and m.num_layers == d.num_layers
