"""MCTS over steps inside the rollout (rljax.train.methods.mcts_search) on a tiny model: the
search is reproducible and each prompt's tree is the same alone or with others; one sampler
call per wave; the self-training batch holds the trees' best verified traces; a tiny
self-training run resumes exactly."""
import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.algorithms import mcts
from rljax.train.core import setup
from rljax.train.methods import mcts_search
from tests.test_selfplay import text_parity_cell, ttt_cfg  # noqa: F401 (a fixture)

DEVICES = jax.devices()[:1]


def tiny_cfg(steps=2, **extra):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": steps, "eval_every": 0, "checkpoint_every": 0, "tokenizer.kind": "char",
        "data.max_prompt_length": 8, "data.step_delimiter": "\n", "algo.name": "sft",
        "sft.traces": "mcts", "sft.steps": 0, "sft.batch_size": 3, "sft.max_length": 20,
        "sft.learning_rate": 1e-3, "optimizer.learning_rate": 1e-3,
        "rollout.max_new_tokens": 12, "rollout.temperature": 1.0,
        "algo.mcts.simulations": 4, "algo.mcts.children": 2, "algo.mcts.rollouts": 2,
        "algo.mcts.max_nodes": 9, "algo.mcts.correct_reward": 0.0,
        "eval.num_examples": 3, "eval.batch_size": 3,
        "logging.tensorboard": False, "checkpoint.async_save": False, **extra})
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "operands": 3, "steps": True, "eval_examples": 3}
    return config_lib.validate(cfg)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    cfg = tiny_cfg()
    setup.check_inputs(cfg, num_devices=1)
    return setup.build_context(cfg, str(tmp_path_factory.mktemp("mcts")), devices=DEVICES)


EXAMPLES = [{"prompt": "3+4-2=", "answer": 5}, {"prompt": "1+1+1=", "answer": 3},
            {"prompt": "9-3+2=", "answer": 8}]


def flat(tree):
    """A tree as comparable data: every node's steps, prior, visits, value, terminal."""
    return [(n.steps, round(n.prior, 6), n.visits, round(n.value_sum, 6), n.terminal)
            for n in mcts_search.walk(tree.root)]


def test_search_is_reproducible_and_a_prompts_tree_is_the_same_alone(ctx):
    key = jax.random.key(7)
    search = mcts_search.MCTSSearch(ctx, rows=3)
    together = [flat(t) for t in search.search(ctx.params, EXAMPLES, key)]
    assert [flat(t) for t in search.search(ctx.params, EXAMPLES, key)] == together
    alone = flat(search.search(ctx.params, EXAMPLES[1:2], key)[0])
    assert alone == together[1]
    reordered = [flat(t) for t in search.search(ctx.params, EXAMPLES[::-1], key)]
    assert reordered == together[::-1]
    other = [flat(t) for t in search.search(ctx.params, EXAMPLES, jax.random.key(8))]
    assert other != together
    assert all(len(t) > 1 for t in together)          # the roots were expanded
    assert all(t[0][2] == 4 for t in together)        # 4 simulations backed up at the root


def test_expansion_samples_once_per_wave(ctx, monkeypatch):
    calls = []
    real = mcts_search.generate

    def counting(*args, **kw):
        calls.append(int(np.shape(args[2])[0]))
        return real(*args, **kw)
    monkeypatch.setattr(mcts_search, "generate", counting)
    search = mcts_search.MCTSSearch(ctx, rows=3)
    trees = search.search(ctx.params, EXAMPLES, jax.random.key(0))
    # A wave expands at most one leaf per prompt, all in one call of `rows` prefix rows.
    assert 1 <= len(calls) <= 4 and set(calls) == {3}
    expanded = sum(n.expanded and n.children != [] for t in trees
                   for n in mcts_search.walk(t.root))
    assert len(calls) < expanded                      # not one call per node


def test_the_self_training_batch_holds_the_best_verified_traces(ctx):
    trees = mcts_search.MCTSSearch(ctx, rows=3).search(ctx.params, EXAMPLES,
                                                       jax.random.key(3))
    threshold = 1.0
    batch, traces = mcts_search.trace_batch(ctx, trees, threshold, 8)
    # A scripted reward on the tree: mark one terminal node of the first tree verified.
    t0 = trees[0]
    terminals = [n for n in mcts_search.walk(t0.root) if n.terminal]
    assert terminals
    for n in terminals:
        t0.info[n.steps]["reward"] = 0.0
    pick = terminals[-1]
    t0.info[pick.steps]["reward"] = 1.0
    for t in trees[1:]:   # the others: no verified trace
        for n in mcts_search.walk(t.root):
            if n.terminal:
                t.info[n.steps]["reward"] = 0.0
    batch, traces = mcts_search.trace_batch(ctx, trees, threshold, 8)
    want = t0.tokens(pick)[:8]
    assert traces == [t0.tokens(pick), None, None]
    c = batch["loss_mask"]
    assert c.shape == (3, 8) and not c[1:].any()
    completion = batch["tokens"][:, -8:]
    assert completion[0][c[0]].tolist() == want
    # The most visited verified terminal wins; with every terminal verified, check by hand.
    for t in trees:
        for n in mcts_search.walk(t.root):
            if n.terminal:
                t.info[n.steps]["reward"] = 1.0
    _, traces = mcts_search.trace_batch(ctx, trees, threshold, 8)
    for t, tr in zip(trees, traces):
        best = max((n.visits for n in mcts_search.walk(t.root) if n.terminal))
        node = mcts_search.best_verified(t, threshold)
        assert node.terminal and node.visits == best and tr == t.tokens(node)


def test_priors_are_the_step_probabilities_normalised(ctx, monkeypatch):
    """A child's prior is exp(sum of its step's token log-probs) over its siblings'."""
    seen = []
    real = mcts.expand

    def spy(node, proposals):
        seen.append(list(proposals))
        return real(node, proposals)
    monkeypatch.setattr(mcts, "expand", spy)
    trees = mcts_search.MCTSSearch(ctx, rows=3).search(ctx.params, EXAMPLES[:1],
                                                       jax.random.key(1))
    root = trees[0].root
    props = seen[0]
    firsts = {}
    for step, p, _ in props:
        firsts.setdefault(step, p)
    total = sum(firsts.values())
    assert [c.prior for c in root.children] == pytest.approx(
        [firsts[c.steps[-1]] / total for c in root.children])
    assert all(0 < p <= 1 for _, p, _ in props)


def test_config_refuses_bad_mcts_settings():
    with pytest.raises(config_lib.ConfigError, match="algo.mcts.prm"):
        tiny_cfg(**{"algo.mcts.value": "prm"})
    with pytest.raises(config_lib.ConfigError, match="algo.name='sft'"):
        tiny_cfg(**{"algo.name": "grpo"})
    with pytest.raises(config_lib.ConfigError, match="max_nodes"):
        tiny_cfg(**{"algo.mcts.max_nodes": 2})
    from rljax.envs.base import register_env
    register_env("test_two_turns", TwoTurnEnv)


def _comparable(workdir):
    from rljax.train.core.metrics import read_metrics
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
            for r in read_metrics(workdir)]


def test_self_training_runs_two_rounds_and_resumes_exactly(tmp_path):
    from rljax.train import run
    from rljax.train.core import checkpoint

    from test_train_loop import StopAfter

    straight, parts = str(tmp_path / "a"), str(tmp_path / "b")
    assert run.train(tiny_cfg(2), straight, devices=DEVICES) == 0
    assert run.train(tiny_cfg(2), parts, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(tiny_cfg(2), parts, devices=DEVICES) == 0
    rounds = [r for r in _comparable(straight) if "mcts/solved_frac" in r]
    assert len(rounds) == 2
    assert {"mcts/nodes_mean", "mcts/depth_mean", "mcts/value_root_mean"} <= set(rounds[0])
    assert _comparable(parts) == _comparable(straight)

    def params(w):
        with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(w)) as ckpt:
            return jax.tree.map(np.asarray, ckpt.restore().state["params"])
    jax.tree.map(np.testing.assert_array_equal, params(parts), params(straight))


def test_row_keys_make_a_rows_tokens_independent_of_its_batch(ctx):
    from rljax import sampling

    tok = ctx.tokenizer
    prompts = [tok.encode("3+4-2="), tok.encode("1+1+1=")]
    keys = jax.random.split(jax.random.key(5), 4)   # 2 prompts x 2 samples

    def draw(ids, row_keys):
        p_tok, p_mask = sampling.pad_to_bucket(ids, pad_id=tok.pad_id, buckets=(8,))
        out = sampling.generate(ctx.model_cfg, ctx.params, p_tok, p_mask,
                                rng=jax.random.key(0), max_new_tokens=10, num_samples=2,
                                eos_id=tok.eos_id, pad_id=tok.pad_id, row_keys=row_keys)
        return np.asarray(out.tokens)
    both = draw(prompts, keys)
    np.testing.assert_array_equal(draw(prompts[1:], keys[2:]), both[2:])
    np.testing.assert_array_equal(draw(prompts[::-1], jax.numpy.concatenate([keys[2:], keys[:2]])),
                                  np.concatenate([both[2:], both[:2]]))
    with pytest.raises(ValueError, match="one key per output row"):
        draw(prompts, keys[:3])


def test_prm_values_are_backed_up(ctx):
    """Value 'prm': a non-root leaf backs up its PRM score (computed when it was created), the
    root its rollouts' mean, a terminal its reward; so every expanded node's value sum is its
    own evaluation plus its children's sums."""
    import dataclasses

    cfg = tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": "unused"})
    scored = []

    def scorer(prompt_ids, prefixes):
        scored.extend(zip(map(tuple, prompt_ids), map(tuple, prefixes)))
        return [0.1 * (len(p) % 7) for p in prefixes]
    search = mcts_search.MCTSSearch(dataclasses.replace(ctx, cfg=cfg), rows=3,
                                    prm_scorer=scorer)
    trees = search.search(ctx.params, EXAMPLES, jax.random.key(2))
    for t in trees:
        for n in mcts_search.walk(t.root):
            info = t.info[n.steps]
            kids = sum(c.value_sum for c in n.children)
            if n.terminal:
                assert n.value_sum == pytest.approx(n.visits * info["reward"])
            elif n.steps and n.expanded:
                assert (t.prompt_ids and (tuple(t.prompt_ids), tuple(t.tokens(n))) in scored)
                assert n.value_sum == pytest.approx(info["score"] + kids)
                assert info["score"] == pytest.approx(0.1 * (len(t.tokens(n)) % 7))
            elif not n.steps:
                assert n.visits == 4 and n.visits == 1 + sum(c.visits for c in n.children)


def write_prm_run(where: str, ctx, cfg=None, **extra) -> str:
    """A PRM run's workdir ``where``: its config (algo.name='prm', ``cfg``'s or
    ``tiny_cfg(**extra)``'s model and tokenizer) and one checkpoint with a value model on
    ``ctx``'s policy trunk."""
    from rljax import models
    from rljax.train.core import checkpoint
    from rljax.train.core import workdir as wd

    cfg = tiny_cfg(**extra) if cfg is None else cfg
    cfg.algo.name, cfg.sft.traces = "prm", ""
    wd.write_config(where, cfg)
    critic = models.init_value_params(ctx.model_cfg, jax.random.key(11), from_params=ctx.params)
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(where), async_save=False) as ck:
        ck.save(1, {"params": ctx.params, "critic_params": critic}, {}, wait=True)
    return where


def test_a_prm_workdir_that_is_not_a_prm_run_is_refused(tmp_path):
    from rljax.errors import UserError
    from rljax.train.core import inputs
    from rljax.train.core import workdir as wd

    other = tmp_path / "rm"
    other.mkdir()
    rm_cfg = tiny_cfg()
    rm_cfg.algo.name, rm_cfg.sft.traces = "rm", ""
    wd.write_config(str(other), rm_cfg)
    cfg = tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": str(other)})
    with pytest.raises(UserError, match="not a process reward model"):
        inputs.check_inputs(cfg, num_devices=1)
    prm_dir = tmp_path / "prm"
    prm_dir.mkdir()
    prm_cfg = tiny_cfg()
    prm_cfg.algo.name, prm_cfg.sft.traces = "prm", ""
    wd.write_config(str(prm_dir), prm_cfg)
    inputs.check_inputs(tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": str(prm_dir)}),
                        num_devices=1)   # a PRM run with this model: accepted
    prm_cfg.model.overrides = {"num_layers": 2}
    wd.write_config(str(prm_dir), prm_cfg)
    with pytest.raises(UserError, match="model section differs"):
        inputs.check_inputs(tiny_cfg(**{"algo.mcts.value": "prm",
                                        "algo.mcts.prm": str(prm_dir)}), num_devices=1)
    with pytest.raises(UserError, match="no config.json"):
        inputs.check_inputs(tiny_cfg(**{"algo.mcts.value": "prm",
                                        "algo.mcts.prm": str(tmp_path / "none")}),
                            num_devices=1)


def test_sibling_pairs_are_the_best_and_worst_valued_children(ctx):
    """data.pairs='mcts': at each expanded node, chosen/rejected = its highest/lowest-valued
    children (visited: Q; terminal: reward), recomputed here from the tree."""
    trees = mcts_search.MCTSSearch(ctx, rows=3).search(ctx.params, EXAMPLES,
                                                       jax.random.key(4))
    found = 0
    for t in trees:
        for n in mcts_search.walk(t.root):   # children's values by their index
            for i, c in enumerate(n.children):
                if c.terminal:
                    t.info[c.steps]["reward"] = 0.1 * i
                else:
                    c.value_sum = 0.37 * i * c.visits
        pairs = mcts_search.sibling_pairs(t, 0.0, 100)
        want = []
        for n in mcts_search.walk(t.root):
            vals = [(c.value if c.visits else t.info[c.steps]["reward"], c) for c in n.children
                    if c.visits or c.terminal]
            if len(vals) < 2:
                continue
            hi, lo = max(vals, key=lambda v: v[0]), min(vals, key=lambda v: v[0])
            if hi[0] > lo[0]:
                want.append((t.prompt_ids + t.tokens(n), list(hi[1].steps[-1]),
                             list(lo[1].steps[-1]), pytest.approx(hi[0] - lo[0]),
                             len(n.steps)))
        assert pairs == want
        found += len(want)
        assert mcts_search.sibling_pairs(t, 0.0, 1) == want[:1]
        assert mcts_search.sibling_pairs(t, 1e9, 100) == []
    assert found


def test_online_dpo_takes_sibling_pairs_from_the_search(ctx):
    """data.pairs='mcts': the DPO phase's source searches rollout.batch_size /
    num_generations prompts and encodes the trees' sibling pairs (pair_mask marks them)."""
    import dataclasses
    import types

    from rljax.train.phases.dpo import DPOPhase

    cfg = tiny_cfg(1, **{"algo.name": "dpo", "algo.online": True, "sft.traces": "",
                         "data.pairs": "mcts", "rollout.batch_size": 6,
                         "algo.num_generations": 2, "algo.step_mc.max_steps": 2,
                         "algo.mcts.simulations": 3})
    phase = DPOPhase(dataclasses.replace(ctx, cfg=cfg), 1)
    assert isinstance(phase.source, mcts_search.MCTSPairs) and phase.num_pairs == 6
    state = types.SimpleNamespace(rng=jax.random.key(9), params=ctx.params)
    batch, m = phase.source(state, 0)
    pairs = [p for t in phase.source.last for p in mcts_search.sibling_pairs(t, 0.0, 2)]
    assert m["mcts/pairs"] == len(pairs) == int(batch["pair_mask"].sum())
    assert batch["chosen_tokens"].shape == (6, 12) and batch["prompt_tokens"].shape == (6, 20)
    for row, (_, chosen, rejected, _, _) in enumerate(pairs):
        assert batch["chosen_tokens"][row][batch["chosen_mask"][row]].tolist() == chosen
        assert batch["rejected_tokens"][row][batch["rejected_mask"][row]].tolist() == rejected


def mcts_dpo_cfg(steps, **extra):
    """Online DPO on the search's sibling pairs, rewarded by ``digit_share`` (a reward that
    tells the untrained policy's samples apart; registered by the test)."""
    return tiny_cfg(steps, **{
        "algo.name": "dpo", "algo.online": True, "sft.traces": "", "data.pairs": "mcts",
        "rollout.batch_size": 4, "algo.num_generations": 2, "algo.step_mc.max_steps": 2,
        "algo.mcts.simulations": 3, "reward.names": ("digit_share",), **extra})


@pytest.fixture
def digit_share_reward(monkeypatch):
    from rljax.rewards import registry
    from test_step_mc import digit_share

    monkeypatch.setitem(registry._REGISTRY, "digit_share", lambda: digit_share)


def test_mcts_pairs_search_the_prompts_the_online_filter_keeps(tmp_path, digit_share_reward):
    """Prompt selection with MCTS pairs: each round's roots are expanded (the first
    simulation), their forks' pass rates filter the prompts, more rounds fill the batch and
    only the kept prompts are searched on; two DPO rounds train on their sibling pairs."""
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    cfg = mcts_dpo_cfg(2, **{"data.selection.name": "online_filter",
                             "data.selection.threshold": 0.2, "data.selection.low": 0.5,
                             "data.selection.high": 0.5, "algo.max_sampling_rounds": 3})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    rounds = [r for r in read_metrics(str(tmp_path)) if "mcts/pairs" in r]
    assert len(rounds) == 2 and all(np.isfinite(r["loss"]) for r in rounds)
    assert max(r["rollout/rounds"] for r in rounds) > 1
    assert 0 < rounds[-1]["selection/in_band_frac"] < 1
    assert sum(r["dpo/pairs"] for r in rounds) > 0


def test_asynchronous_mcts_pairs_with_prompt_selection_and_a_refitted_prm_resume_exactly(
        ctx, tmp_path, digit_share_reward, monkeypatch):
    """Asynchronous DPO on MCTS pairs: the sampler searches the next round's trees on a device
    of its own with the version a step behind, MoPPS picking the prompts, the leaves valued by
    a refitted PRM. The sampler's search reads the PRM published with the policy (batch
    k + 1, sampled at iteration k by version k, reads the PRM as refitted at iteration k - 1,
    on the trees of batch k - 1 that the batch carried); stopped after the first update and
    resumed (the pair batch in flight with its refit rows, and the posteriors saved), the run
    equals the straight one, PRM losses included."""
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods import prm_refit
    from test_train_loop import resumes_exactly

    searched, refitted = [], []   # the PRM heads the search read, the refits' results
    search_prm, fit = mcts_search.refitted, prm_refit.PRMRefit.fit

    def reading(scorer, state):
        searched.append(jax.tree.map(np.asarray, state.critic_params["head"]))
        return search_prm(scorer, state)

    def fitting(self, state, *rows):
        state, m = fit(self, state, *rows)
        refitted.append(jax.tree.map(np.asarray, state.critic_params["head"]))
        return state, m
    monkeypatch.setattr(mcts_search, "refitted", reading)
    monkeypatch.setattr(prm_refit.PRMRefit, "fit", fitting)
    prm = write_prm_run(str(tmp_path / "prm"), ctx)
    cfg = lambda: mcts_dpo_cfg(3, **{  # noqa: E731
        "algo.asynchronous": True, "mesh.rollout_devices": 1, "mesh.data": 1, "mesh.fsdp": 1,
        "mesh.rollout.data": 1, "mesh.rollout.fsdp": 1, "data.selection.name": "predicted",
        "data.selection.pool_factor": 2, "algo.mcts.value": "prm", "algo.mcts.prm": prm,
        "algo.mcts.refit_prm": True, "algo.mcts.refit_learning_rate": 0.1})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1, devices=jax.devices()[:2])
    rounds = [r for r in read_metrics(straight) if "mcts/pairs" in r]
    assert [r["rollout/sample_version"] for r in rounds] == [0, 0, 1]
    assert all(np.isfinite(r["loss"]) and r["mcts/prm_rows"] > 0
               and np.isfinite(r["mcts/prm_loss"]) for r in rounds)
    assert rounds[-1]["selection/tracked"] > 0 and sum(r["dpo/pairs"] for r in rounds) > 0
    # Each round's search reads the PRM at several waves. The straight run: PRM 0 (batches 0
    # and 1), then the first refit's result (batch 2); the stopped run: PRM 0; the resumed
    # run: the PRM its checkpoint holds, the first refit's (batch 2).
    def same(a, b):
        return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))
    reads = [h for i, h in enumerate(searched) if i == 0 or not same(h, searched[i - 1])]
    assert len(reads) == 4 and same(reads[0], reads[2]) and not same(reads[0], reads[1])
    assert same(reads[1], refitted[0]) and same(reads[3], refitted[0])


def test_a_search_sharded_on_8_devices_equals_unsharded(ctx, tmp_path, monkeypatch):
    """Value 'prm' on a data=8 mesh (3 prompts padded to 8 prefix rows, their keys and the
    PRM's batches split over the devices) grows the trees one device grows: same nodes,
    visits and best traces; priors, values and PRM scores to float32 rounding."""
    import dataclasses

    from rljax import models
    from rljax.train.methods import mcts_programs

    cfg = tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": "unused"})
    eight = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:8])
    assert eight.dp_size == 8
    value = models.init_value_params(ctx.model_cfg, jax.random.key(3), from_params=ctx.params)
    calls = []
    real = mcts_search.generate

    def spy(c, params, p_tok, p_mask, rng, **kw):
        calls.append((p_tok.shape, kw["row_keys"].sharding.spec))
        return real(c, params, p_tok, p_mask, rng, **kw)
    monkeypatch.setattr(mcts_search, "generate", spy)

    def search(c, params):
        rows = mcts_programs.search_rows(3, c.dp_size)
        scorer = mcts_programs.prm_scorer(c, value, rows * 2)
        return mcts_search.MCTSSearch(c, 3, scorer).search(params, EXAMPLES, jax.random.key(7))
    one = search(dataclasses.replace(ctx, cfg=cfg), ctx.params)
    calls.clear()
    sharded = search(eight, jax.device_put(ctx.params, eight.param_shardings))
    assert calls and all(c == ((8, 20), jax.sharding.PartitionSpec("data")) for c in calls)
    for a, b in zip(one, sharded):
        na, nb = list(mcts_search.walk(a.root)), list(mcts_search.walk(b.root))
        assert [(n.steps, n.visits, n.terminal) for n in na] == \
            [(n.steps, n.visits, n.terminal) for n in nb]
        for x, y in zip(na, nb):
            assert (x.prior, x.value_sum) == pytest.approx((y.prior, y.value_sum), abs=1e-5)
            assert a.info[x.steps] == pytest.approx(b.info[y.steps], abs=1e-5)
    assert sum(len(list(mcts_search.walk(t.root))) for t in one) > 6
    assert any("score" in info for t in one for info in t.info.values())
    assert (mcts_search.trace_batch(ctx, one, 0.0, 8)[1]
            == mcts_search.trace_batch(ctx, sharded, 0.0, 8)[1])


def test_the_plan_lists_the_search_programs_at_the_shapes_a_round_calls(ctx, tmp_path,
                                                                         monkeypatch):
    """rljax plan of sft.traces='mcts' with value 'prm' on a data=8 mesh: mcts/sample is one
    wave's sampler call (8 prefix rows of 8 + 12 columns, a key per fork) and mcts/prm the
    PRM's pass over 8 x 2 stepwise rows, at the shapes and shardings of the calls a round
    makes; both compile. Online DPO with data.pairs='mcts' plans the same search (4 prompts
    padded to 8 rows) instead of the rollout's sampler."""
    from rljax import models
    from rljax import plan as plan_lib
    from rljax.train import phases
    from rljax.train.core import workdir as wd
    from rljax.train.methods import mcts_programs, prm_rerank

    prm_cfg = tiny_cfg()
    prm_cfg.algo.name, prm_cfg.sft.traces = "prm", ""
    wd.write_config(str(tmp_path), prm_cfg)
    cfg = tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": str(tmp_path),
                      "sft.batch_size": 8})
    devices = jax.devices()[:8]
    abstract, _ = plan_lib.abstract_context(cfg, devices)
    planned = {p.name: p for _, _, ps in phases.phase_programs(abstract) for p in ps}
    assert set(planned) == {"update", "mcts/sample", "mcts/prm"}
    _, p_tok, p_mask, _, keys = planned["mcts/sample"].args
    assert (p_tok.shape, p_mask.shape, keys.shape) == ((8, 20), (8, 20), (16, 2))
    value, batch = planned["mcts/prm"].args
    assert batch["prompt_tokens"].shape == (16, 8) and batch["labels"].shape == (16, 12)
    for name in ("mcts/sample", "mcts/prm"):
        p = planned[name]
        assert p.fn.lower(*p.args).compile().memory_analysis() is not None

    # A round of the run's search on the same mesh, its PRM a fresh value head.
    eight = setup.build_context(cfg, str(tmp_path / "run"), devices=devices)
    head = models.init_value_params(ctx.model_cfg, jax.random.key(3), from_params=ctx.params)
    monkeypatch.setattr(mcts_programs, "load_prm_scorer",
                        lambda c, rows: mcts_programs.prm_scorer(c, head, rows))
    sampled, scored = [], []
    real_generate, real_program = mcts_search.generate, prm_rerank.value_logits_program

    def generate(c, params, p_tok, p_mask, rng, **kw):
        sampled.append((p_tok.shape, p_mask.shape, kw["num_samples"], kw["row_keys"]))
        return real_generate(c, params, p_tok, p_mask, rng, **kw)

    def program(model_cfg):
        fn = real_program(model_cfg)

        def run(v, b):
            scored.append((v, b))
            return fn(v, b)
        return run
    monkeypatch.setattr(mcts_search, "generate", generate)
    monkeypatch.setattr(prm_rerank, "value_logits_program", program)
    search = mcts_search.searcher(eight, int(cfg.sft.batch_size))
    # A raw key, as the train state's; seed 24: trees that grow past their roots' children.
    round_key = jax.random.fold_in(jax.random.PRNGKey(24), mcts_search.MCTS_STREAM)
    search.search(jax.device_put(ctx.params, eight.param_shardings), EXAMPLES, round_key)
    assert len(sampled) > 1 and scored

    def same(real, abstract):   # shape, dtype and placement
        return (real.shape == abstract.shape and real.dtype == abstract.dtype
                and real.sharding.is_equivalent_to(abstract.sharding, len(real.shape)))
    for shape, mask_shape, forks, row_keys in sampled:
        assert (shape, mask_shape, forks) == (p_tok.shape, p_mask.shape, 2)
        assert same(row_keys, keys)
    for v, b in scored:
        assert jax.tree.all(jax.tree.map(same, v, value))
        assert jax.tree.all(jax.tree.map(same, b, batch))

    dpo = tiny_cfg(1, **{"algo.name": "dpo", "algo.online": True, "sft.traces": "",
                         "data.pairs": "mcts", "rollout.batch_size": 8,
                         "algo.num_generations": 2, "algo.step_mc.max_steps": 2,
                         "eval.batch_size": 8})
    abstract, _ = plan_lib.abstract_context(dpo, devices)
    planned = {p.name: p for _, _, ps in phases.phase_programs(abstract) for p in ps}
    assert set(planned) == {"eval", "mcts/sample", "update"}
    assert [a.shape for a in planned["mcts/sample"].args[1:]] == [(8, 20), (8, 20), (2,),
                                                                 (16, 2)]
    # With algo.mcts.refit_prm the PRM in the state is refitted on 4 x (4 - 1) rows a round;
    # with LoRA the state holds its adapters and head only.
    lora_prm = str(tmp_path / "lora_prm")
    prm_cfg.model.lora.rank = 4
    wd.write_config(lora_prm, prm_cfg)
    for where, lora in ((str(tmp_path), 0), (lora_prm, 4)):
        refit = dpo.copy_and_resolve_references()
        refit.update_from_flattened_dict({
            "algo.mcts.value": "prm", "algo.mcts.prm": where, "algo.mcts.refit_prm": True,
            "model.lora.rank": lora})
        abstract, _ = plan_lib.abstract_context(config_lib.validate(refit), devices)
        planned = {p.name: p for _, _, ps in phases.phase_programs(abstract) for p in ps}
        assert set(planned) == {"eval", "mcts/sample", "mcts/prm", "update", "prm_refit"}
        state, batch = planned["prm_refit"].args
        assert batch["labels"].shape == (12, 12)
        trunk = set(state.critic_params["trunk"])
        assert trunk == {"lora"} if lora else "embed" in trunk and "lora" not in trunk


class TwoTurnEnv:
    """Answers the first turn with ``<o>LEN</o>``; ends after the second with reward 1 when
    the two turns' lengths have the same parity (so sibling turns differ in value)."""

    def __init__(self, example):
        self.example, self.lengths = example, []

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        from rljax.envs.base import StepResult
        self.lengths.append(len(text))
        if len(self.lengths) == 2:
            return StepResult(reward=float(self.lengths[0] % 2 == self.lengths[1] % 2),
                              done=True)
        return StepResult(observation=[{"role": "tool", "content": f"<o>{len(text)}</o>"}])


EPISODE_SEARCH = {"env.name": "test_two_turns", "env.tools": (), "env.max_turn_tokens": 4,
                  "env.max_total_tokens": 24, "env.max_obs_tokens": 8, "reward.names": (),
                  "sft.max_length": 32, "algo.mcts.correct_reward": 1.0}


@pytest.fixture(scope="module")
def ectx(tmp_path_factory):
    """The context of a search over ``TwoTurnEnv``'s turns."""
    from rljax.envs.base import register_env

    register_env("test_two_turns", TwoTurnEnv)
    cfg = tiny_cfg(**EPISODE_SEARCH)
    setup.check_inputs(cfg, num_devices=1)
    return setup.build_context(cfg, str(tmp_path_factory.mktemp("episodes")), devices=DEVICES)


def test_the_search_over_an_environments_turns_trains_on_episode_traces(ectx, tmp_path):
    """A node is a turn boundary: its children are model turns, its trajectory holds the
    environment's observation, a terminal node's reward is the episode's; the traces train on
    the model's turns only; two rounds of self-training run (with env.turn_discount and a
    PRM's values, the PRM refitted each round)."""
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods import mcts_episodes

    search = mcts_episodes.searcher(ectx, 3)
    assert isinstance(search, mcts_episodes.EpisodeSearch)
    trees = search.search(ectx.params, EXAMPLES, jax.random.key(5))
    assert [flat(t) for t in search.search(ectx.params, EXAMPLES, jax.random.key(5))] == [
        flat(t) for t in trees]
    for t in trees:
        for n in mcts_search.walk(t.root):
            assert len(n.steps) <= 2 and all(len(turn) <= 4 for turn in n.steps)
            assert (len(n.steps) == 2) == n.terminal   # the environment ends after turn 2
            ids, trains = t.trace(n)
            assert sum(trains) == sum(len(turn) for turn in n.steps)
            if n.steps:   # the observation after turn 1 is context, not trained
                assert not all(trains) and ectx.tokenizer.decode(ids).count("<o>") == 1
            if n.terminal:
                assert t.info[n.steps]["reward"] in (0.0, 1.0)
    assert max(max(len(n.steps) for n in mcts_search.walk(t.root)) for t in trees) == 2
    batch, traces = mcts_search.trace_batch(ectx, trees, 1.0, 24)
    found = [i for i, tr in enumerate(traces) if tr is not None]
    assert found, "no tree found a rewarded episode"
    for i in found:
        n = batch["loss_mask"][i].sum()
        assert 0 < n < len(traces[i])   # the observation's tokens do not train

    # The run's values discounted per turn (env.turn_discount: the root's R_0 <= gamma), its
    # leaves valued by a PRM run's scores at their turn ends (algo.mcts.value='prm'), that
    # PRM refitted each round on the nodes' values at their turn ends (algo.mcts.refit_prm).
    prm = write_prm_run(str(tmp_path / "prm"), ectx)
    cfg = tiny_cfg(**EPISODE_SEARCH, **{"env.turn_discount": 0.5, "algo.mcts.value": "prm",
                                        "algo.mcts.prm": prm, "algo.mcts.refit_prm": True})
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    rounds = [r for r in read_metrics(str(tmp_path / "run")) if "mcts/solved_frac" in r]
    assert len(rounds) == 2
    assert all(np.isfinite(r["sft/loss"]) and r["mcts/depth_mean"] > 1 and r["mcts/traces"] > 0
               and 0 < r["mcts/value_root_mean"] <= 0.5 and r["mcts/prm_rows"] > 0
               and r["mcts/prm_labels"] > r["mcts/prm_rows"] and np.isfinite(r["mcts/prm_loss"])
               for r in rounds)


def test_mcts_pairs_over_an_environments_turns_pair_sibling_turns(tmp_path):
    """data.pairs='mcts' with env.name: the search's nodes are turn boundaries, so a pair's
    context is the prompt and the episode so far (the environment's observation included)
    and its chosen and rejected steps are sibling model turns; a DPO round trains."""
    import types

    from rljax.envs.base import register_env
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods import mcts_episodes
    from rljax.train.phases.dpo import DPOPhase

    register_env("test_two_turns", TwoTurnEnv)
    cfg = lambda: mcts_dpo_cfg(1, **EPISODE_SEARCH, **{"rollout.batch_size": 6})  # noqa: E731
    ectx = setup.build_context(cfg(), str(tmp_path / "ctx"), devices=DEVICES)
    phase = DPOPhase(ectx, 1)
    assert isinstance(phase.source.searcher, mcts_episodes.EpisodeSearch)
    batch, m = phase.source(types.SimpleNamespace(rng=jax.random.key(1), params=ectx.params), 0)
    real = np.flatnonzero(batch["pair_mask"])
    assert real.size and m["mcts/pairs"] == real.size
    tok = ectx.tokenizer
    contexts = [tok.decode(batch["prompt_tokens"][i][batch["prompt_mask"][i]]) for i in real]
    assert any("<o>" in c for c in contexts)   # a pair after turn 1: the observation is context
    for i in real:   # the steps are model turns (env.max_turn_tokens = 4), not observations
        for side in ("chosen", "rejected"):
            turn = batch[f"{side}_tokens"][i][batch[f"{side}_mask"][i]]
            assert 0 < len(turn) <= 4 and "<o>" not in tok.decode(turn)
    assert run.train(cfg(), str(tmp_path / "run"), devices=DEVICES) == 0
    (train,) = [r for r in read_metrics(str(tmp_path / "run")) if "mcts/pairs" in r]
    assert np.isfinite(train["loss"]) and train["dpo/pairs"] > 0


def test_the_search_over_turns_backs_up_discounted_turn_returns(ectx):
    """env.turn_discount: a node after d turns backs up the return of the turn that made it
    (the root its episode's): with TwoTurnEnv's final reward r, r at depth 2 and gamma r above
    (a step reward on turn 1 counts at every depth). gamma 1 grows the undiscounted trees
    exactly; gamma 0.5 halves the values above the terminals (the run with it: the test
    above)."""
    import dataclasses

    from rljax.algorithms import turn_credit
    from rljax.train.methods import mcts_episodes

    gamma = 0.5
    returns = turn_credit.turn_returns(np.array([[0.2, 1.0]]), np.array([2]), gamma)
    np.testing.assert_allclose(mcts_episodes.path_values(returns, 3), [0.7, 0.7, 1.0])

    def trees(discount):
        cfg = tiny_cfg(**EPISODE_SEARCH, **({} if discount is None else
                                            {"env.turn_discount": discount}))
        return mcts_episodes.searcher(dataclasses.replace(ectx, cfg=cfg), 3).search(
            ectx.params, EXAMPLES, jax.random.key(5))
    outcome = [flat(t) for t in trees(None)]
    assert [flat(t) for t in trees(1.0)] == outcome
    discounted = trees(gamma)
    assert [flat(t) for t in discounted] != outcome
    rewarded = 0
    for t in discounted:
        for n in mcts_search.walk(t.root):
            kids = [c for c in n.children if c.visits]
            if n.terminal:   # turn 2 made it: R_1 = r, undiscounted
                assert n.value_sum == pytest.approx(n.visits * t.info[n.steps]["reward"])
                assert t.terminal_value(n) == t.info[n.steps]["reward"]
                continue
            # Its own evaluations (the mean of 2 forks' gamma r each) and its children's sums,
            # those at depth 2 discounted once more on the way up.
            below = sum(c.value_sum * (gamma if c.terminal else 1.0) for c in kids)
            own = (n.value_sum - below) / gamma * 2
            evaluations = n.visits - sum(c.visits for c in kids)
            assert own == pytest.approx(round(own)) and 0 <= round(own) <= 2 * evaluations
            assert n.value <= gamma + 1e-6
            rewarded += n.value > 0
    assert rewarded


def test_a_prm_values_the_search_over_turns_at_its_turn_ends(ectx, tmp_path):
    """algo.mcts.value='prm' over turns: the PRM reads a node's trajectory (model turns and
    observations, each token's model turn given) and a non-root leaf backs up its score
    there, the root its forks' mean, a terminal its reward; the score is the one at the end
    of the node's last model turn (the observation after it changes nothing). With
    env.turn_discount the score stands in for the return from the leaf on: gamma 1 grows the
    same trees, gamma 0.5 discounts the score once per turn up the path. The refit's rows
    label each turn's end with its node's Q (a run refitting a PRM run's: the test above)."""
    import dataclasses

    from rljax.train.methods import mcts_episodes, mcts_programs, prm_refit

    scored = []

    def scorer(prompt_ids, trajectories, turns):
        scored.extend(zip(trajectories, turns))
        return [0.1 * (len(t) % 7) for t in trajectories]

    def trees(**extra):
        cfg = tiny_cfg(**EPISODE_SEARCH, **{"algo.mcts.value": "prm", "algo.mcts.prm": "x",
                                            **extra})
        return mcts_episodes.searcher(dataclasses.replace(ectx, cfg=cfg), 3, scorer).search(
            ectx.params, EXAMPLES, jax.random.key(5))
    undiscounted = trees()
    assert scored
    for t in undiscounted:
        for n in mcts_search.walk(t.root):
            info, kids = t.info[n.steps], sum(c.value_sum for c in n.children)
            if n.terminal:
                assert n.value_sum == pytest.approx(n.visits * info["reward"])
            elif n.steps:
                assert (list(info["trajectory"]), list(info["turn_ids"])) in scored
                assert [k >= 0 for k in info["turn_ids"]] == list(info["model"])
                assert len(set(info["turn_ids"]) - {-1}) == len(n.steps)
                if n.expanded:
                    assert n.value_sum == pytest.approx(info["score"] + kids)
    # The refit's rows (algo.mcts.refit_prm): each valued node's trajectory, turn k labelled
    # with its path node's Q on its last model token, where the scorer reads turn k.
    for t in undiscounted:
        rows = prm_refit.label_rows(t)
        valued = [n for n in mcts_search.walk(t.root) if n.steps and n.visits]
        assert len(rows) == len(valued)
        for (_, comp, ends, labels), n in zip(rows, valued):
            turns = t.info[n.steps]["turn_ids"]
            assert comp == list(t.info[n.steps]["trajectory"]) and len(ends) == len(n.steps)
            assert [turns[e] for e in ends] == list(range(len(n.steps)))
            assert all(e + 1 == len(turns) or turns[e + 1] != turns[e] for e in ends)
            assert labels == pytest.approx([min(max(p.value, 0.0), 1.0)
                                            for p in prm_refit.path_nodes(t, n)])
    assert [flat(t) for t in trees(**{"env.turn_discount": 1.0})] == [
        flat(t) for t in undiscounted]
    gamma, checked = 0.5, 0
    for t in trees(**{"env.turn_discount": gamma}):
        for n in mcts_search.walk(t.root):
            if len(n.steps) == 1 and n.expanded and not n.terminal:
                # its score once, then its terminal children's rewards, all from turn 0 on
                kids = sum(c.value_sum for c in n.children)
                assert n.value_sum == pytest.approx(gamma * (t.info[n.steps]["score"] + kids))
                checked += kids > 0
    assert checked

    # A PRM run's workdir: its score of a trajectory is the one at its last model token.
    prm = write_prm_run(str(tmp_path / "prm"), ectx)
    cfg = tiny_cfg(1, **EPISODE_SEARCH, **{"algo.mcts.value": "prm", "algo.mcts.prm": prm})
    real = mcts_programs.load_prm_scorer(dataclasses.replace(ectx, cfg=cfg), 6)
    node = max((n for t in undiscounted for n in mcts_search.walk(t.root) if n.steps
                and not n.terminal), key=lambda n: len(n.steps))
    info = next(t.info[node.steps] for t in undiscounted if node.steps in t.info)
    turns = list(info["turn_ids"])
    last = max(k for k, turn in enumerate(turns) if turn >= 0) + 1
    assert last < len(turns)   # an observation follows the node's turn
    prompt = undiscounted[0].prompt_ids
    whole, cut = real([prompt] * 2, [list(info["trajectory"]), list(info["trajectory"][:last])],
                      [turns, turns[:last]])
    assert 0 < whole < 1 and whole == pytest.approx(cut, abs=1e-6)
    # With algo.mcts.refit_prm the search over turns reads the PRM the refit trains.
    from rljax.train.phases.sft import SFTPhase
    refit = tiny_cfg(1, **EPISODE_SEARCH, **{"algo.mcts.value": "prm", "algo.mcts.prm": prm,
                                             "algo.mcts.refit_prm": True})
    phase = SFTPhase(dataclasses.replace(ectx, cfg=refit), 1, 1e-3)
    assert isinstance(phase.traces.searcher, mcts_episodes.EpisodeSearch)
    assert phase.traces.searcher.prm_scorer is phase.refit.scorer


# ----------------------------------------------------------------------------- self-play

SELFPLAY_SEARCH = {"env.selfplay.mode": "self", "algo.name": "sft", "sft.traces": "mcts",
                   "sft.batch_size": 4, "data.step_delimiter": "\n",
                   "algo.mcts.simulations": 4, "algo.mcts.children": 2,
                   "algo.mcts.rollouts": 2, "algo.mcts.max_nodes": 9,
                   "algo.mcts.correct_reward": 1.0}


def replayed_match(example: dict, history, tok) -> tuple[list[int], float]:
    """(each ply's seat, the example's seat's reward) of the tictactoe match whose turns,
    every seat's in ply order, are ``history``, replayed through fresh seat environments."""
    from rljax.envs import board_games
    from rljax.envs.selfplay import Match, SeatEnv, seat_example
    from rljax.train.methods.selfplay import seat_of

    game = board_games.get_game("tictactoe")
    match = Match(game, example.get("deal"))
    envs = [SeatEnv(match, seat_example(example, s, game), s) for s in range(len(game.seats))]
    for env in envs:
        env.reset()
    seats, rewards = [], np.zeros(len(envs))
    for ids in history:
        seats.append(match.to_move())
        rewards[seats[-1]] += envs[seats[-1]].step(tok.decode(list(ids))).reward
    for s, env in enumerate(envs):
        if match.over() and not env.done:
            rewards[s] += env.finish().reward
    return seats, float(rewards[seat_of(game, example)])


@pytest.mark.parametrize("discount", [None, 0.5])
def test_the_search_over_a_matchs_turns_replays_every_seat_and_values_the_learners(
        tmp_path, monkeypatch, text_parity_cell, discount):
    """env.selfplay with sft.traces='mcts': a tree is a match seen from its example's seat
    (the learner's); a node's history, every seat's turns, replays to the node: the learner's
    turns in it are the node's steps, and each child's match and trajectory start with its
    parent's (its fork replayed the parent's history, the other seat's moves included); a
    terminal node's reward is the learner seat's in its match, what it backs up. A round of
    self-training trains on the learner's winning traces. With env.turn_discount a
    non-terminal node after d turns backs up its forks' return of turn d-1, gamma times a
    later turn's (the game pays at its end only): at most gamma in size."""
    from rljax.envs import board_games
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods.selfplay import seat_of

    trees, call = [], mcts_search.MCTSTraces.__call__
    monkeypatch.setattr(mcts_search.MCTSTraces, "__call__", lambda self, *a: (
        call(self, *a), trees.extend(self.last))[0])
    cfg = ttt_cfg(**SELFPLAY_SEARCH, steps=1,
                  **({} if discount is None else {"env.turn_discount": discount}))
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    (r,) = [r for r in read_metrics(str(tmp_path)) if "mcts/solved_frac" in r]
    assert np.isfinite(r["sft/loss"]) and r["mcts/traces"] > 0 and r["mcts/depth_mean"] > 1
    tok, seconds, rewards, valued = setup.make_tokenizer(cfg, None), 0, set(), 0
    for t in trees:
        own = seat_of(board_games.get_game("tictactoe"), t.example)
        seconds += int(own == 1 and len(t.info[()]["history"]) == 1)   # O opens on X's move
        for n in mcts_search.walk(t.root):
            info = t.info[n.steps]
            seats, reward = replayed_match(t.example, info["history"], tok)
            assert [ids for s, ids in zip(seats, info["history"]) if s == own] == list(n.steps)
            for c in n.children:
                child = t.info[c.steps]
                assert child["history"][:len(info["history"])] == info["history"]
                assert child["trajectory"][:len(info["trajectory"])] == info["trajectory"]
            if n.terminal:
                assert info["reward"] == reward
                assert n.value_sum == pytest.approx(n.visits * reward)
                rewards.add(reward)
            elif n.steps and n.visits and discount is not None:
                assert abs(n.value) <= discount + 1e-6
                valued += n.value != 0
    assert seconds and {-1.0, 1.0} <= rewards
    assert valued or discount is None


def test_a_prm_values_the_search_over_a_matchs_turns_with_discounted_returns(
        tmp_path, monkeypatch, text_parity_cell):
    """env.selfplay with sft.traces='mcts', algo.mcts.value='prm' (a PRM run's workdir) and
    env.turn_discount: the PRM reads each node's learner trajectory (the other seat's moves
    as observations), and a non-root leaf backs up its score as the return from it on, so
    with no reward before a match's end a node's value sum is gamma (its score + its
    children's sums), a terminal's its reward per visit; a round of self-training runs."""
    import dataclasses

    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods import mcts_programs
    from rljax.train.methods.mcts_matches import MatchSearch

    gamma, ctx = 0.5, setup.build_context(ttt_cfg(), str(tmp_path / "ctx"), devices=DEVICES)
    prm = write_prm_run(str(tmp_path / "prm"), ctx, cfg=ttt_cfg())
    trees, scored, searches = [], [], []
    call, load = mcts_search.MCTSTraces.__call__, mcts_programs.load_prm_scorer
    monkeypatch.setattr(mcts_search.MCTSTraces, "__call__", lambda self, *a: (
        call(self, *a), trees.extend(self.last), searches.append(self.searcher))[0])

    def loaded(*a):
        real = load(*a)

        def scorer(prompt_ids, trajectories, turns):
            scored.extend(zip(map(tuple, trajectories), map(tuple, turns)))
            return real(prompt_ids, trajectories, turns)
        return scorer
    monkeypatch.setattr(mcts_programs, "load_prm_scorer", loaded)
    cfg = ttt_cfg(**SELFPLAY_SEARCH, steps=1, **{"algo.mcts.value": "prm", "algo.mcts.prm": prm,
                                                 "env.turn_discount": gamma})
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    (r,) = [r for r in read_metrics(str(tmp_path / "run")) if "mcts/solved_frac" in r]
    assert np.isfinite(r["sft/loss"]) and r["mcts/depth_mean"] > 1
    assert isinstance(searches[0], MatchSearch) and searches[0].gamma == gamma
    checked, observed = 0, 0
    for t in trees:
        for n in mcts_search.walk(t.root):
            info, kids = t.info[n.steps], sum(c.value_sum for c in n.children)
            if n.terminal:
                assert n.value_sum == pytest.approx(n.visits * info["reward"])
            elif n.steps:
                assert (info["trajectory"], info["turn_ids"]) in scored
                assert 0 < info["score"] < 1
                observed += -1 in info["turn_ids"][info["turn_ids"].index(0):]
                if n.expanded:
                    assert n.value_sum == pytest.approx(gamma * (info["score"] + kids))
                    checked += 1
    assert checked and observed


def write_opponent_run(where: str, cfg, params) -> str:
    """A run's workdir ``where``: ``cfg`` and one checkpoint holding ``params`` (a frozen
    opponent for ``env.selfplay.mode='checkpoint'``)."""
    from rljax.train.core import checkpoint
    from rljax.train.core import workdir as wd

    wd.write_config(where, cfg)
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(where), async_save=False) as ck:
        ck.save(1, {"params": params}, {}, wait=True)
    return where


def test_mcts_pairs_in_selfplay_pair_the_learner_seats_turns_against_a_checkpoint(
        tmp_path, monkeypatch, text_parity_cell):
    """data.pairs='mcts' with env.selfplay.mode='checkpoint': the search's forks play the
    other seat with the frozen checkpoint (greedy: every O tree opens on the same X move); a
    pair's context is the learner seat's match so far, the opponent's moves as
    observations, its chosen and rejected steps sibling learner turns; a DPO round trains."""
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods.mcts_matches import MatchSearch

    def cfg(**extra):
        return ttt_cfg(**{"algo.name": "dpo", "algo.online": True, "data.pairs": "mcts",
                          "data.step_delimiter": "\n", "data.kwargs.seat": "O",
                          "rollout.batch_size": 4, "algo.num_generations": 2,
                          "algo.step_mc.max_steps": 2, "algo.mcts.simulations": 3,
                          "algo.mcts.children": 2, "algo.mcts.rollouts": 2, "steps": 1,
                          **extra})
    ctx = setup.build_context(cfg(), str(tmp_path / "ctx"), devices=DEVICES)
    opponent = write_opponent_run(str(tmp_path / "opponent"), cfg(), ctx.params)
    seen, call = [], mcts_search.MCTSPairs.__call__

    def watched(self, *args):   # the source's search, its trees and its pair batch
        out = call(self, *args)
        seen.append((self.searcher, self.last, out))
        return out
    monkeypatch.setattr(mcts_search.MCTSPairs, "__call__", watched)
    workdir = str(tmp_path / "run")
    assert run.train(cfg(**{"env.selfplay.mode": "checkpoint",
                            "env.selfplay.workdir": opponent}), workdir, devices=DEVICES) == 0
    ((search, trees, (batch, m)),) = seen
    assert isinstance(search, MatchSearch) and search.opponent is not None
    openings = {t.info[()]["history"] for t in trees}
    assert len(trees) == 2 and len(openings) == 1 and len(next(iter(openings))) == 1
    (train,) = [r for r in read_metrics(workdir) if "mcts/pairs" in r]
    assert np.isfinite(train["loss"]) and train["dpo/pairs"] > 0
    real = np.flatnonzero(batch["pair_mask"])
    assert real.size and m["mcts/pairs"] == real.size
    tok = ctx.tokenizer
    for i in real:   # after X's move (the first observation); the steps are O's turns
        context = tok.decode(batch["prompt_tokens"][i][batch["prompt_mask"][i]])
        assert context.startswith("tictactoe O\n") and "X" in context[len("tictactoe O\n"):]
        for side in ("chosen", "rejected"):
            assert 0 < batch[f"{side}_mask"][i].sum() <= 2   # env.max_turn_tokens
