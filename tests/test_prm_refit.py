"""The search's PRM refitted on the search's per-step values each round
(rljax.train.methods.prm_refit, algo.mcts.refit_prm) on a tiny model: the labels are the
trees' node values at the nodes' step ends; the refit trains the PRM and the next round's
search reads it; a run stopped after its first round resumes exactly."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.train.methods import mcts_programs, mcts_search, prm_refit, prm_rerank

from test_mcts_rollout import (DEVICES, EXAMPLES, _comparable, ctx, tiny_cfg,  # noqa: F401
                               write_prm_run)


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory, ctx):  # noqa: F811
    """A PRM run's workdir: its config (algo.name='prm', the policy's model and tokenizer)
    and one checkpoint with a value model on the policy's trunk."""
    return write_prm_run(str(tmp_path_factory.mktemp("prm_run")), ctx)


@pytest.fixture(scope="module")
def lora_prm_dir(tmp_path_factory, ctx):  # noqa: F811
    """A PRM run's workdir with LoRA (rank 4): its checkpoint holds its policy's adapters and
    the PRM's adapters and head, not the frozen base (as ``state.for_checkpoint`` writes)."""
    from rljax.models import lora as lora_lib
    from rljax.train.core import checkpoint
    from rljax.train.core import workdir as wd

    d = str(tmp_path_factory.mktemp("lora_prm_run"))
    cfg = tiny_cfg(**LORA)
    cfg.algo.name, cfg.sft.traces = "prm", ""
    wd.write_config(d, cfg)
    adapters = lora_lib.init_lora(ctx.model_cfg, 4, lora_lib.resolve_targets(
        cfg.model.lora.targets), jax.random.key(10))
    policy = {**ctx.params, "lora": adapters}   # the base is the run's: the same model section
    critic = lora_lib.init_value_adapters(ctx.model_cfg, policy, jax.random.key(11))
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(d), async_save=False) as ck:
        ck.save(1, {"params": lora_lib.trainable(policy), "critic_params": critic}, {},
                wait=True)
    return d


LORA = {"model.lora.rank": 4}
# Online DPO on the search's sibling pairs (data.pairs='mcts'); SimPO's loss, the one without
# a reference pass, keeps the runs short.
DPO = {"algo.name": "dpo", "algo.online": True, "sft.traces": "", "data.pairs": "mcts",
       "rollout.batch_size": 6, "algo.num_generations": 2, "algo.step_mc.max_steps": 2,
       "algo.loss_type": "simpo"}


def refit_cfg(prm_dir, steps=2, **extra):
    return tiny_cfg(steps, **{"algo.mcts.value": "prm", "algo.mcts.prm": prm_dir,
                              "algo.mcts.refit_prm": True, **extra})


def test_refit_needs_the_prm_value_and_a_search():
    with pytest.raises(config_lib.ConfigError, match="algo.mcts.refit_prm"):
        tiny_cfg(**{"algo.mcts.refit_prm": True})
    with pytest.raises(config_lib.ConfigError, match="algo.mcts.refit_prm.*sft.traces"):
        tiny_cfg(**{"algo.mcts.refit_prm": True, "sft.traces": ""})
    # Online DPO on the search's pairs refits too, and LoRA runs refit the PRM's adapters.
    tiny_cfg(**DPO, **{"algo.mcts.value": "prm", "algo.mcts.prm": "runs/prm",
                       "algo.mcts.refit_prm": True})
    refit_cfg("runs/prm", **{"model.lora.rank": 4})


def test_a_lora_prm_run_is_read_on_the_policys_base(ctx, lora_prm_dir):  # noqa: F811
    """A LoRA PRM run's checkpoint holds no base: its value model is its adapters and head on
    this run's frozen base (the same model section)."""
    from rljax.train.methods import prm_scoring

    rctx = dataclasses.replace(ctx, cfg=refit_cfg(lora_prm_dir, **LORA))
    saved = mcts_programs.load_prm(rctx)
    value = prm_scoring.prm_value(rctx, saved)
    assert set(saved["critic_params"]["trunk"]) == {"lora"}
    assert value["trunk"]["lora"] is saved["critic_params"]["trunk"]["lora"]
    assert value["trunk"]["embed"] is ctx.params["embed"] and "lm_head" not in value["trunk"]


def _recomputed(tree, node):
    """(visits, value sum) of a subtree from the evaluations alone: a terminal node's reward
    at each visit; any other node its own PRM score once (the root: its rollouts' mean, the
    rest of its sum) plus its children's sums."""
    if node.terminal:
        return node.visits, node.visits * tree.info[node.steps]["reward"]
    kids = [_recomputed(tree, c) for c in node.children]
    own = tree.info[node.steps]["score"] if node.steps else None
    visits = 1 + sum(v for v, _ in kids)
    if own is None:   # the root: whatever its rollouts backed up
        return visits, node.value_sum
    return visits, own + sum(s for _, s in kids)


def test_labels_are_the_nodes_values_at_their_step_ends(ctx):  # noqa: F811
    cfg = tiny_cfg(**{"algo.mcts.value": "prm", "algo.mcts.prm": "unused"})
    # Scores above 1 too: a label is Q clipped to [0, 1].
    search = mcts_search.MCTSSearch(dataclasses.replace(ctx, cfg=cfg), rows=3,
                                    prm_scorer=lambda _, ps: [0.3 * (len(p) % 7) for p in ps])
    trees = search.search(ctx.params, EXAMPLES, jax.random.key(2))
    tok, want = ctx.tokenizer, []
    for t in trees:
        rows = prm_refit.label_rows(t)
        valued = [n for n in mcts_search.walk(t.root) if n.steps and n.visits]
        assert len(rows) == len(valued) <= 4 - 1
        for row, node in zip(rows, valued):
            prompt, comp, ends, labels = row
            assert prompt == t.prompt_ids and comp == t.tokens(node)
            path, cur = [], t.root
            for step in node.steps:   # the path, found by the steps themselves
                cur = next(c for c in cur.children if c.steps[-1] == step)
                path.append(cur)
            qs = []
            for n in path:
                visits, total = _recomputed(t, n)
                assert visits == n.visits
                qs.append(min(max(total / visits, 0.0), 1.0))
            assert labels == pytest.approx(qs)
            assert ends == [sum(len(s) for s in node.steps[:k + 1]) - 1
                            for k in range(len(node.steps))]
            if not node.terminal:   # where the search's scorer reads the same steps
                scored = prm_rerank.step_rows([prompt], [comp], tok.decode, "\n",
                                              tuple(ctx.stop_ids))[0][2]
                assert scored == ends
        want += rows
    assert want and any(lab == 1.0 for r in want for lab in r[3])   # some were clipped
    batch, count = prm_refit.refit_batch(trees, 12, 8, 12, tok.pad_id)
    assert count == len(want) < 12 and batch["row_mask"].sum() == count
    for i, (prompt, comp, ends, labels) in enumerate(want):
        assert np.flatnonzero(batch["label_mask"][i]).tolist() == ends
        np.testing.assert_allclose(batch["labels"][i, ends], labels, rtol=1e-6)
        assert batch["completion_tokens"][i, :len(comp)].tolist() == comp
    assert not batch["label_mask"][count:].any()   # padded rows weigh nothing


def test_refit_trains_the_prm_and_the_next_search_reads_it(ctx, prm_dir,  # noqa: F811
                                                           monkeypatch):
    from rljax.train.inference import initial_state, start_phase
    from rljax.train.phases.sft import SFTPhase

    cfg = refit_cfg(prm_dir, **{"algo.mcts.refit_updates": 3,
                                "algo.mcts.refit_learning_rate": 3e-3})
    rctx = dataclasses.replace(ctx, cfg=cfg)
    phase = SFTPhase(rctx, 2, 1e-3)
    state = start_phase(rctx, phase, initial_state(rctx))
    before = jax.tree.map(np.asarray, state.critic_params)
    _, m = phase.traces(state, 0)
    state, refit = phase.refit(state, phase.traces.last)
    assert refit["mcts/prm_rows"] == len([r for t in phase.traces.last
                                          for r in prm_refit.label_rows(t)]) > 0
    assert refit["mcts/prm_loss_last"] < refit["mcts/prm_loss"]
    after = jax.tree.map(np.asarray, state.critic_params)
    assert not np.array_equal(after["head"]["kernel"], before["head"]["kernel"])
    assert int(state.step) == 0   # the SFT update counts the round, not the refit
    seen = []
    real = mcts_programs.PRMScorer.__call__

    def spy(self, prompt_ids, prefixes):
        seen.append(np.asarray(self.value["head"]["kernel"]))
        return real(self, prompt_ids, prefixes)
    monkeypatch.setattr(mcts_programs.PRMScorer, "__call__", spy)
    phase.traces(state, 1)
    assert seen and all(np.array_equal(s, after["head"]["kernel"]) for s in seen)


@pytest.mark.parametrize("prm, extra", [("prm_dir", {}), ("lora_prm_dir", {**DPO, **LORA})],
                         ids=["sft", "online_dpo_lora"])
def test_a_refit_run_resumes_exactly(tmp_path, request, prm, extra):
    """SFT on the search's traces, and online DPO on its pairs with LoRA (the PRM's adapters
    and head refitted on the policy's base): a run stopped after its first round resumes
    exactly, the refitted PRM included."""
    from rljax.train import run
    from rljax.train.core import checkpoint

    from test_train_loop import StopAfter

    prm_dir = request.getfixturevalue(prm)
    straight, parts = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = functools.partial(refit_cfg, prm_dir, 2, **extra)
    assert run.train(cfg(), straight, devices=DEVICES) == 0
    assert run.train(cfg(), parts, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg(), parts, devices=DEVICES) == 0
    rounds = [r for r in _comparable(straight) if "mcts/prm_rows" in r]
    assert len(rounds) == 2 and all(r["mcts/prm_rows"] > 0 for r in rounds)
    assert _comparable(parts) == _comparable(straight)

    def state(w):
        with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(w)) as ckpt:
            s = ckpt.restore().state
            return jax.tree.map(np.asarray, {k: s[k] for k in ("params", "critic_params",
                                                               "critic_opt_state")})
    a, b = state(straight), state(parts)
    jax.tree.map(np.testing.assert_array_equal, b, a)
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(prm_dir)) as ckpt:
        start = jax.tree.map(np.asarray, ckpt.restore().state["critic_params"])
    assert not np.array_equal(a["critic_params"]["head"]["kernel"], start["head"]["kernel"])
    if extra:   # LoRA: the PRM's adapters trained too, and no base was saved with them
        assert set(a["critic_params"]["trunk"]) == {"lora"}
        assert any(not np.array_equal(x, y) for x, y in zip(
            jax.tree.leaves(a["critic_params"]["trunk"]), jax.tree.leaves(start["trunk"])))
