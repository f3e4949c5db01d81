"""The plan compiles the programs the phases run: for every algorithm, one real iteration on
the tiny model, each update program captured as the phase calls it, against ``rljax plan``.

For each captured call: XLA's memory analysis of the program the phase ran (lowered from the
call's real arguments) equals the plan's row (arguments, outputs, aliased, temporaries); the
live jax arrays grow across the call by exactly the plan's outputs - aliased (less the output
tuple's pointer table); the live train
state is the plan's resident state; so the plan's peak is the one measured."""
import gc

import jax
import numpy as np
import pytest

from rljax import plan as plan_lib
from rljax.train import inference
from rljax.train.core import image_inputs, setup
from rljax.train.phases import make_phases

from test_train_loop import tiny_cfg

ALGORITHMS = {
    # Two mini-batches of 8 (old log-probs recomputed), each two micro-batches of whole groups.
    "grpo": {"algo.micro_batch_size": 4},
    # GRPO's update with the teacher's scores (and the JSD term's top-k) in its batch.
    "distill": {"algo.name": "distill", "algo.beta": 0.0, "algo.micro_batch_size": 4,
                "algo.distill.jsd_weight": 0.5, "algo.distill.top_k": 4},
    "ppo": {"algo.name": "ppo", "algo.adv_estimator": "gae", "algo.beta": 0.0},
    "dpo": {"algo.name": "dpo", "algo.beta": 0.1, "algo.mini_batch_size": 0},
    "sft": {"algo.name": "sft", "algo.beta": 0.0, "algo.mini_batch_size": 0},
    "rm": {"algo.name": "rm", "algo.beta": 0.0, "algo.mini_batch_size": 0},
    # Labels sampled on the task (the sampler is not planned): the update on stepwise rows.
    "prm": {"algo.name": "prm", "algo.beta": 0.0, "algo.mini_batch_size": 0,
            "data.kwargs": {"digits": 1, "operands": 3, "steps": True, "eval_examples": 8}},
    # LoRA over a base kept in int4 (two entries a byte), one scale per 16 inputs.
    "qlora": {"algo.micro_batch_size": 4, "model.lora.rank": 4, "model.lora.alpha": 8.0,
              "model.quantize": "int4", "model.quantize_block": 16},
    # Images in the prompt: the tower in the train state, pixels in the update's batch (one
    # per group in the shared-prompt layout), the tower's pass for the sampler.
    "vlm": {"algo.micro_batch_size": 4, "model.preset": "tiny-vlm",
            "model.vision.image_token": "@", "model.overrides": {"num_layers": 1},
            "data.source": "shapes", "data.kwargs": {"kinds": "count", "eval_examples": 8},
            "data.max_prompt_length": 32, "reward.names": ("arithmetic",)},
    # A mixture of experts replaying the sampler's routes in the shared-prompt layout: each
    # group's prompt routes once, the completion columns' per row.
    "moe_replay": {"algo.micro_batch_size": 4, "model.preset": "tiny-moe",
                   "model.overrides": {"num_layers": 1, "moe_intermediate_size": 16},
                   "algo.routing_replay": True},
}


@pytest.fixture(autouse=True)
def _older_objects_out_of_the_collectors_view():
    """Each recorded call collects cyclic garbage twice; a full collection scans every object
    the worker holds (0.4 s each after a real-model file), so what exists before the test is
    frozen once, collected first: only this test's objects are scanned, and none of the
    frozen garbage can be freed between the two sides of a measurement."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


class Recorder:
    """Calls a jitted program and records, per call, the live bytes it added and XLA's memory
    analysis of the program compiled for the call's arguments."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def lower(self, *args, **kwargs):
        return self.fn.lower(*args, **kwargs)

    def __call__(self, *args):
        # Arrays only a reference cycle keeps (earlier steps, earlier tests in this worker)
        # would otherwise count as live on one side of the difference and not the other.
        gc.collect()
        before = plan_lib.measure_live_bytes()
        out = jax.block_until_ready(self.fn(*args))
        gc.collect()
        growth = plan_lib.measure_live_bytes() - before
        stats = self.fn.lower(*args).compile().memory_analysis()
        state = next((a for a in args if hasattr(a, "opt_state")), None)
        self.calls.append({"name": self.name, "growth": growth, "stats": stats,
                           "outputs": len(jax.tree.leaves(out)),
                           "state": plan_lib.shard_bytes(state) if state is not None else 0})
        return out


def capture(phase, state, calls):
    """Wraps the update programs of ``phase`` (built for ``state``) in ``Recorder``s."""
    step = phase._compiled(state)
    if phase.name in ("grpo", "distill"):   # a GroupedUpdate: a stream's gradients, then the apply
        step._grads = Recorder("update", step._grads, calls)
        step._micro = Recorder("update", step._micro, calls)
        step._apply_fns[1] = Recorder("apply", step._apply_fn(1), calls)
    else:
        phase._step_fn = Recorder("update", step, calls)
    if phase.name == "ppo":
        phase.prepare = Recorder("prepare", phase.prepare, calls)


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_planned_update_programs_are_the_ones_a_step_runs(algo, tmp_path):
    overrides = dict(ALGORITHMS[algo])
    if algo == "distill":   # a teacher to read: a workdir with a checkpoint
        from test_distill import write_teacher_workdir
        write_teacher_workdir(tmp_path / "teacher")
        overrides["algo.distill.teacher"] = str(tmp_path / "teacher")
    cfg = tiny_cfg(**{"sft.steps": 0, "algo.update_streams": 1, **overrides})
    devices = jax.devices()[:1]
    # Only the programs this test measures (the sampler's and log-probs' are other tests').
    # A mixture of experts planned as training compiles it (not at a balanced load).
    planned = plan_lib.plan(cfg, devices, moe_balanced=False, programs=lambda name: name in (
        "prepare", "update", "apply", "sample/images"))
    rows = {p.name: p for p in planned.phases}

    ctx = setup.build_context(cfg, str(tmp_path), devices)
    phase = make_phases(ctx)[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    state_bytes = plan_lib.shard_bytes(state)
    assert state_bytes == planned.resident, (state_bytes, planned.resident_parts)
    if algo == "distill":
        # The teacher (loaded at the first rollout, not train state) is loaded now, and its
        # shards listed once: listing a checkpoint-restored array's shards the first time adds
        # views of its buffers to the live arrays (no memory), which the first update's
        # measurement would otherwise count as its own.
        next(s for s in phase.rollout.stages if s.name == "teacher").teacher()
        plan_lib.measure_live_bytes()
    calls, image_calls = [], []
    capture(phase, state, calls)
    if algo == "vlm":   # the tower's pass that embeds each rollout's images for the sampler
        embed = image_inputs.embed_fn(ctx.model_cfg)
        tower = Recorder("sample/images", embed, image_calls)
        phase.rollout.images.embeds = lambda params, pixels: tower(params["vision"], pixels)
    state, _ = phase.iteration(state, 0)
    jax.block_until_ready(state)

    names = {c["name"] for c in calls}
    assert names == {n for n in ("prepare", "update", "apply") if n in rows}, (names, rows)
    assert bool(image_calls) == (algo == "vlm")
    for call in image_calls:
        row, stats = rows[call["name"]], call["stats"]
        real = (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                stats.temp_size_in_bytes)
        assert real == (row.arguments, row.outputs, row.temps), (call, row)
        assert call["growth"] == row.outputs - row.aliased, (call, row)   # one array out
    for call in calls:
        row, stats = rows[call["name"]], call["stats"]
        real = (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                stats.alias_size_in_bytes, stats.temp_size_in_bytes)
        assert real == (row.arguments, row.outputs, row.aliased, row.temps), (call, row)
        # XLA's outputs also count the output tuple's table of buffer pointers (8 bytes each
        # on CPU), which is no jax array.
        table = 8 * call["outputs"]
        assert call["growth"] + table == row.outputs - row.aliased, (call, row)
        assert call["state"] == row.resident_arguments, (call, row)
        measured_peak = (state_bytes + stats.argument_size_in_bytes - call["state"]
                         + call["growth"] + table + stats.temp_size_in_bytes
                         + stats.generated_code_size_in_bytes)
        assert row.peak(planned.resident) == measured_peak, (call, row)
    assert np.isfinite(planned.peak)



@pytest.mark.parametrize("engine", ["static", "slots"])
def test_a_checkpoint_opponent_is_planned_as_its_own_sampler(engine, tmp_path, monkeypatch):
    """env.selfplay.mode='checkpoint': the plan reads the opponent's architecture from its
    workdir (no weight loaded) and holds its parameters resident, as many bytes as the loaded
    opponent's; its sampler programs are its own side's (the turn batches' start and turn, or
    on the slot engine its episode engine's prefill and decode), over as many rows as a round
    gives it; on the slot engine each side holds a slot per row (the policy's too)."""
    from test_distill import write_teacher_workdir
    from test_selfplay import ttt_cfg
    from rljax import data as data_lib
    from rljax.train.core import evaluate
    from rljax.train.methods import agent, selfplay
    from rljax.train.phases import phase_programs
    workdir = str(tmp_path / "opponent")   # wider than the policy: its own architecture
    write_teacher_workdir(workdir, cfg=ttt_cfg(**{"model.overrides.hidden_size": 48}))
    cfg = ttt_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": workdir,
                     "rollout.engine": engine})
    devices = jax.devices()[:1]
    planned = plan_lib.plan(cfg, devices, programs=lambda name: name.startswith("sample/opp"))
    ctx = setup.build_context(cfg, str(tmp_path), devices)
    opponent = selfplay.load_opponent(ctx)
    size = plan_lib.shard_bytes(opponent.params)
    assert size > plan_lib.shard_bytes(ctx.params)
    assert planned.resident_parts["opponent"] == size
    assert planned.resident == plan_lib.shard_bytes(
        inference.start_phase(ctx, make_phases(ctx)[-1], inference.initial_state(ctx))) + size
    names = ("prefill", "decode") if engine == "slots" else ("start", "turn")
    assert [p.name for p in planned.phases] == [f"sample/opponent_{n}" for n in names]
    assert all(row.resident_arguments == size for row in planned.phases)

    # The rows of one round's sides, as the rollout hands them to the matches.
    sides = []
    monkeypatch.setattr(selfplay, "run_matches", lambda s, *a, **k: sides.append(s) or [{}])
    selfplay.play(ctx, ctx.params, evaluate.eval_examples(ctx), jax.random.key(0),
                  num_samples=2, temperature=1.0, opponent=opponent,
                  template=data_lib.make_template(ctx.data_config(), ctx.tokenizer),
                  **agent.match_options(cfg, ctx))
    mine, theirs = (len(side.envs) for side in sides[0])
    progs = {p.name: p for p in phase_programs(plan_lib.abstract_context(cfg, devices)[0])[-1][2]}
    if engine == "slots":   # the decode chunk's slot state
        assert progs["sample/opponent_decode"].args[5]["live"].shape == (theirs,)
        assert progs["sample/episode_decode"].args[5]["live"].shape == (mine,)
    else:   # the turn's slot mask [R, S]
        assert progs["sample/opponent_turn"].args[2].shape[0] == theirs


def kuhn_cfg(**overrides):
    """test_selfplay's tiny config on Kuhn Poker: P2's first observation (the card and P1's
    move) is longer than P1's board, so P2's prompt ++ opening outgrows the 32-token prompt
    bucket that holds P1's prompt."""
    from test_selfplay import ttt_cfg
    from rljax import config as config_lib
    cfg = ttt_cfg(**{"data.source": "kuhn_poker", "env.name": "kuhn_poker", "env.max_turns": 2,
                     "env.max_turn_tokens": 6, "env.max_obs_tokens": 28,
                     "rollout.max_new_tokens": 6, "data.max_prompt_length": 32,
                     "env.kwargs": {"opponent": "random", "illegal_penalty": -2.0}})
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


def shapes(tree):
    return jax.tree.map(np.shape, tree)


def watch_engines(monkeypatch) -> dict:
    """Each match engine a rollout starts, by side ("episode": the learner seat's, "opponent":
    the other seats', the checkpoint opponent's or in self-play the policy's):
    ``(prompt pages, cache shapes, state shapes)`` (``matches._EngineSide``: a call's
    sides, the learner's first; partial rollouts: ``partial_matches._SeatEngine``)."""
    from rljax.train.methods import matches, partial_matches
    engines: dict = {"episode": [], "opponent": []}
    side_init, seat_init = matches._EngineSide.__init__, partial_matches._SeatEngine.__init__

    def side(self, run, *a, **k):
        side_init(self, run, *a, **k)
        name = "opponent" if len(engines["episode"]) > len(engines["opponent"]) else "episode"
        engines[name].append((len(run.p_tok), shapes(self.cache), shapes(self.state)))

    def seat(self, pool, run, lim, rows, side, frozen, *a, **k):
        seat_init(self, pool, run, lim, rows, side, frozen, *a, **k)
        engines["opponent" if frozen else "episode"].append(
            (len(rows[::pool.g]), shapes(self.cache), shapes(self.state)))
    monkeypatch.setattr(matches._EngineSide, "__init__", side)
    monkeypatch.setattr(partial_matches._SeatEngine, "__init__", seat)
    return engines


@pytest.mark.parametrize("engine", ["static", "slots", "partial"])
def test_trees_against_a_checkpoint_opponent_are_planned_at_the_shapes_they_run(
        engine, tmp_path, monkeypatch):
    """rollout.tree with env.selfplay.mode='checkpoint': a P2 learner's tree grows from its
    prompt ++ P1's opening, in the P + env.max_total_tokens bucket, which the plan's tree
    programs take (static: ``sample``; slot engine: its widest level's; partial rollouts: a
    place's tree, one prompt); the openings are the opponent's static plies over one match
    per example (partial: per place; ``sample/opening_*``), and the matches after the tree
    run on the episode engine, whatever the sampler, a slot per row with a whole
    trajectory's feed (``sample/episode_decode``, ``sample/opponent_decode``; partial: over
    the pool's 4 places): one iteration's live shapes equal the plan's."""
    from test_distill import write_teacher_workdir
    from test_selfplay import ttt_cfg
    from rljax.envs.selfplay import SeatEnv
    from rljax.sampling import multiturn, tree_engine
    from rljax.train.methods import tree_episodes
    from rljax.train.phases import phase_programs
    workdir = str(tmp_path / "opponent")
    write_teacher_workdir(workdir, cfg=ttt_cfg())
    partial = {"rollout.partial": True, "rollout.chunk_steps": 2, "rollout.slots": 3,
               "rollout.max_staleness": 1} if engine == "partial" else {}
    cfg = kuhn_cfg(**{"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": workdir,
                      "env.selfplay.temperature": 1.0,
                      "rollout.engine": "static" if engine == "static" else "slots",
                      "algo.adv_estimator": "treepo", "algo.num_generations": 4,
                      "rollout.tree.enabled": True, "rollout.tree.roots": 2,
                      "rollout.tree.branching": 2, "rollout.tree.segment_tokens": 1,
                      **partial})
    devices = jax.devices()[:1]
    planned = {p.name: p for p in phase_programs(
        plan_lib.abstract_context(cfg, devices)[0])[-1][2]}

    step = SeatEnv.step   # every turn plays the legal move its text picks: the matches go on
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(self, (
        moves := self.game.legal_moves(self.match.state))[sum(map(ord, text)) % len(moves)]))
    trees, levels, plies = [], [], []
    first_turns = tree_episodes.FirstTurns.__call__
    monkeypatch.setattr(tree_episodes.FirstTurns, "__call__", lambda self, t, m: trees.append(
        np.shape(t)) or first_turns(self, t, m))
    level = tree_engine.engine.generate
    monkeypatch.setattr(tree_engine.engine, "generate", lambda cfg_, params, t, *a, **k: (
        levels.append(np.shape(t)) or level(cfg_, params, t, *a, **k)))
    engines = watch_engines(monkeypatch)
    turn = multiturn.turn
    monkeypatch.setattr(multiturn, "turn", lambda model_cfg, params, cache, slot_mask, chunk,
                        *a, **k: plies.append((shapes(cache), np.shape(slot_mask),
                                               np.shape(chunk)))
                        or turn(model_cfg, params, cache, slot_mask, chunk, *a, **k))

    ctx = setup.build_context(cfg, str(tmp_path / "run"), devices)
    phase = make_phases(ctx)[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    phase.iteration(state, 0)

    p = 32 + 64   # the tree's prompt bucket: a P2's prompt ++ opening is longer than 32
    prompts = 1 if partial else 2   # partial: a place's tree, a P1's in a bucket of 32
    assert max(trees) == (prompts, p) and len(trees) == (4 if partial else 1)
    if engine == "static":
        assert planned["sample"].args[1].shape == (prompts, p)
    else:   # the widest level: 4 leaves a prompt, their pages past the tree's fork points
        assert levels and planned["sample/prefill"].args[1].shape == max(levels)
    assert plies and all(len(engines[name]) == 1 for name in engines)
    for name, [(pages, cache, live_state)] in engines.items():
        _, _, _, page_len, cache_, state_, _ = planned[f"sample/{name}_decode"].args
        assert (page_len.shape[0], shapes(cache_), shapes(state_)) == (pages, cache,
                                                                       live_state), name
    _, cache_, slot_mask, chunk, *_ = planned["sample/opening_turn"].args
    assert all(ply == (shapes(cache_), slot_mask.shape, chunk.shape) for ply in plies)
    assert planned["sample/opening_start"].args[1].shape[0] == slot_mask.shape[0] == prompts


@pytest.mark.parametrize("mode", ["off", "self", "checkpoint"])
def test_the_search_over_turns_is_planned_at_the_shapes_its_forks_run(mode, tmp_path,
                                                                      monkeypatch):
    """sft.traces='mcts' over a game's turns: a wave's forks are played on the episode engine,
    not by ``mcts/sample``. Against the scripted opponent (one seat) they are episodes
    (``mcts/episode_*``: a page per tree, padded to the batch's 8, their 2 x 2 forks on
    ``rollout.slots`` = 3 slots). In self-play they are matches, 3 of the 2 trees x 2 forks a
    batch, the learner seat's rows on the policy's engine (``mcts/episode_*``) and the other
    seat's on the policy's too (self-play: the same program) or the checkpoint opponent's
    (``mcts/opponent_*``). One iteration's engines have the plan's shapes."""
    from test_distill import write_teacher_workdir
    from test_selfplay import ttt_cfg
    from rljax.envs.selfplay import SeatEnv
    from rljax.train.phases import phase_programs
    opponent = {}
    if mode == "checkpoint":
        opponent = {"env.selfplay.workdir": str(tmp_path / "opponent")}
        write_teacher_workdir(opponent["env.selfplay.workdir"], cfg=ttt_cfg())
    cfg = ttt_cfg(**{"env.selfplay.mode": mode, **opponent, "algo.name": "sft",
                     "sft.traces": "mcts", "sft.batch_size": 2, "algo.mcts.simulations": 2,
                     "algo.mcts.children": 2, "algo.mcts.rollouts": 2, "rollout.slots": 3,
                     "steps": 1})
    devices = jax.devices()[:1]
    planned = {p.name: p for p in phase_programs(
        plan_lib.abstract_context(cfg, devices)[0])[-1][2]}
    others = "opponent" if mode == "checkpoint" else "episode"
    assert set(planned) == {"update", "mcts/episode_prefill", "mcts/episode_decode"} | {
        f"mcts/{others}_prefill", f"mcts/{others}_decode"}
    if mode == "off":
        return search_over_episodes(cfg, planned["mcts/episode_decode"], tmp_path, monkeypatch)

    step = SeatEnv.step   # every turn plays the legal move its text picks: the trees grow
    monkeypatch.setattr(SeatEnv, "step", lambda self, text: step(self, (
        moves := self.game.legal_moves(self.match.state))[sum(map(ord, text)) % len(moves)]))
    engines = watch_engines(monkeypatch)
    ctx = setup.build_context(cfg, str(tmp_path / "run"), devices)
    phase = make_phases(ctx)[-1]
    phase.iteration(inference.start_phase(ctx, phase, inference.initial_state(ctx)), 0)
    assert engines["episode"] and len(engines["opponent"]) == len(engines["episode"])
    for side, name in (("episode", "episode"), ("opponent", others)):   # the largest batch:
        _, _, _, page_len, cache_, state_, _ = planned[f"mcts/{name}_decode"].args   # forks'
        assert max(engines[side], key=lambda e: e[0]) == (
            page_len.shape[0], shapes(cache_), shapes(state_)), name
    # (a wave that opens roots plays one match per tree: 2 rows)
    assert sorted({pages for pages, _, _ in engines["episode"]}) == [2, 3]


def search_over_episodes(cfg, planned, tmp_path, monkeypatch):
    """One iteration of an episode search: its forks' engines (``vine_episodes.play_forks``:
    pages, slot cache, state) have the shapes of ``planned``, the plan's decode program."""
    from rljax.models import paged
    from rljax.sampling import episode_engine
    engines = []
    prefill, cache, empty = episode_engine.prefill, paged.init_slot_cache, \
        episode_engine.empty_state
    monkeypatch.setattr(episode_engine, "prefill", lambda m, p, t, *a, **k: engines.append(
        [len(t)]) or prefill(m, p, t, *a, **k))
    monkeypatch.setattr(paged, "init_slot_cache", lambda *a, **k: engines[-1].append(
        c := cache(*a, **k)) or c)
    monkeypatch.setattr(episode_engine, "empty_state", lambda *a, **k: engines[-1].append(
        s := empty(*a, **k)) or s)   # (a schedule's ``temp`` joins it in place)
    devices = jax.devices()[:1]
    ctx = setup.build_context(cfg, str(tmp_path / "run"), devices)
    phase = make_phases(ctx)[-1]
    phase.iteration(inference.start_phase(ctx, phase, inference.initial_state(ctx)), 0)
    _, _, _, page_len, cache_, state_, _ = planned.args
    live = [(pages, shapes(c), shapes(s)) for pages, c, s in engines]
    assert max(live, key=lambda e: e[2]["row"]) == (page_len.shape[0], shapes(cache_),
                                                   shapes(state_))
    assert {e[0] for e in live} == {8} and len(live) > 1
