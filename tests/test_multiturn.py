"""Multi-turn sampling: the KV cache continued turn by turn (observation chunks prefilled, the
turn's tail cut on the host) gives the log-probs of a full forward over the concatenated
trajectory, for every model family; host episodes (rendering, cutting after a tool call's
closing text, masks, budgets) and determinism."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling, tokenizers
from rljax.sampling import multiturn
from rljax.envs.base import StepResult
from rljax.train.core import episodes, render


def _full_logps(cfg, params, prompt_tok, prompt_mask, traj, traj_mask):
    """Reference: token_logps over prompt ++ trajectory (one uncached forward)."""
    seq = np.concatenate([prompt_tok, traj], axis=1)
    mask = np.concatenate([prompt_mask, traj_mask], axis=1)
    fwd = jax.jit(lambda p, s, m: models.token_logps(cfg, p, s, attention_mask=m)[0])
    return np.asarray(fwd(params, jnp.asarray(seq), jnp.asarray(mask)))[:, prompt_tok.shape[1]:]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma"])
def test_continued_cache_equals_full_forward(family):
    """Three turns of sampling with random observation chunks (1-4 tokens, left-padded in a
    4-wide chunk), random cuts of each turn (as after a tool call's closing text) and rows
    finishing early: every kept model token's sampler log-prob equals the full forward's."""
    cfg = models.get_preset("tiny", init_std=0.1, model_type=family, vocab_size=32)
    params = models.init_params(cfg, jax.random.key(0))
    pt, pm = sampling.pad_to_bucket([[5, 17, 3, 9, 12], [7, 8], [9, 10, 11, 12, 13, 14, 15]],
                                    pad_id=0, buckets=(8,))
    g = 2
    rows = pt.shape[0] * g
    layout = multiturn.SlotLayout(prompt_len=8, turn_len=6, chunk_len=5, max_turns=3)
    opts = dict(temperature=1.0, pad_id=0, eos_id=2)
    rs = np.random.default_rng(0)
    cache = multiturn.start(cfg, params, pt, pm, layout=layout, num_samples=g)
    chunk, cmask, slot = multiturn.first_chunk(pt, pm, layout, g)
    traj = [[] for _ in range(rows)]   # (token, is_model, sampler logp)
    active = np.ones(rows, bool)
    for turn in range(layout.max_turns):
        cache, out = multiturn.turn(cfg, params, cache, slot, chunk, cmask, turn=turn,
                                    active=active, budget=np.full(rows, 6),
                                    rng=jax.random.key(1 + turn), layout=layout, **opts)
        tok, lp, ln = (np.asarray(x) for x in (out.tokens, out.logps, out.lengths))
        assert np.all(ln[~active] == 0) and np.all(ln[active] >= 1)
        kept = np.minimum(ln, rs.integers(1, 7, rows)) * active
        slot |= multiturn.kept_slots(layout, turn, kept)
        for r in range(rows):
            traj[r] += [(int(tok[r, i]), True, float(lp[r, i])) for i in range(kept[r])]
        active &= rs.random(rows) < 0.7
        chunk, cmask = np.zeros((rows, 5), np.int32), np.zeros((rows, 5), bool)
        for r in np.flatnonzero(active):   # the turn's last token, then 1-4 observation tokens
            ids = rs.integers(4, 32, rs.integers(1, 5))
            chunk[r, 4 - len(ids):] = [tok[r, kept[r] - 1]] + list(ids)
            cmask[r, 4 - len(ids):] = True
            traj[r] += [(int(i), False, 0.0) for i in ids]
        if turn + 1 < layout.max_turns:
            slot[:, layout.chunk_start(turn + 1):layout.turn_start(turn + 1)] = cmask
    width = max(len(t) for t in traj)
    toks = np.zeros((rows, width), np.int32)
    tmask, mmask = np.zeros((rows, width), bool), np.zeros((rows, width), bool)
    sampler = np.zeros((rows, width), np.float32)
    for r, t in enumerate(traj):
        for i, (tk, is_model, lpv) in enumerate(t):
            toks[r, i], tmask[r, i], mmask[r, i], sampler[r, i] = tk, True, is_model, lpv
    assert mmask.sum() > 30 and (tmask & ~mmask).sum() > 5
    full = _full_logps(cfg, params, np.repeat(pt, g, 0), np.repeat(pm, g, 0), toks, tmask)
    np.testing.assert_allclose(sampler[mmask], full[mmask], atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- host episodes

class CountingEnv:
    """Replies ``<r>len</r>`` to each turn; done after a turn without ``<c`` or 3 turns.
    Reward 0.1 per turn, 1 at the end."""

    def __init__(self, example):
        self.example, self.t = example, 0

    def reset(self):
        return [{"role": "user", "content": self.example["q"]}]

    def step(self, text):
        self.t += 1
        if self.t >= 3 or "c" not in text:
            return StepResult(reward=1.0, done=True, info={"tool_calls": 0})
        return StepResult(observation=[{"role": "tool", "content": f"<r>{len(text)}</r>"}],
                          reward=0.1, info={"tool_calls": 1, "tool:count": 1})


@pytest.fixture(scope="module")
def char_model():
    tok = tokenizers.CharTokenizer("0123456789+*=<>/rcz")
    # A sharp random model over a 23-token vocab: turns end on EOS or "</c>" often enough.
    cfg = models.get_preset("tiny", init_std=0.1, vocab_size=tok.vocab_size)
    params = models.init_params(cfg, jax.random.key(4))
    params = dict(params, lm_head=params["lm_head"] * 2.0)
    return tok, cfg, params


def _run(char_model, seed=1, chat=False, engine=None, record_routes=False, first_turn=None,
         **kw):
    tok, cfg, params = char_model
    envs = [CountingEnv({"q": q}) for q in ["12*3=", "7+8=", "90="] for _ in range(4)]
    limits = episodes.EpisodeLimits(**dict(dict(turn_tokens=8, chunk_tokens=12, max_turns=3,
                                                 max_total_tokens=32, prompt_buckets=(8,)), **kw))
    return episodes.run_episodes(cfg, params, tok, envs, limits=limits,
                                 renderer=render.Renderer(tok, chat=chat, call_end="</c>"),
                                 rng=jax.random.key(seed), num_samples=4, engine=engine,
                                 record_routes=record_routes, first_turn=first_turn)


def test_episodes_logps_masks_and_cuts(char_model):
    tok, cfg, params = char_model
    eps = _run(char_model)
    p = eps["prompt_len"]
    pt, pm = sampling.pad_to_bucket(eps["prompt_ids"], pad_id=0, buckets=(p,))
    full = _full_logps(cfg, params, pt, pm, eps["tokens"], eps["mask"])
    mm = eps["model_mask"]
    np.testing.assert_allclose(eps["logps"][mm], full[mm], atol=2e-5, rtol=0)
    assert np.all(eps["logps"][~mm] == 0) and np.all(mm <= eps["mask"])
    assert eps["turns"].max() >= 2, "some episode should take several turns"
    for i in range(len(eps["transcripts"])):
        # Observation tokens are exactly the rendered tool results; model tokens the rest.
        obs = tok.decode(eps["tokens"][i][eps["mask"][i] & ~mm[i]].tolist())
        assert obs == "".join(f"<r>{n}</r>" for n in _obs_lengths(eps["transcripts"][i]))
        # A turn (a run of model tokens) never continues past the tool call's closing text.
        for turn in _model_runs(tok, eps["tokens"][i], mm[i]):
            assert "</c>" not in turn or (turn.endswith("</c>") and turn.count("</c>") == 1)
        assert eps["turns"][i] == 1 + eps["transcripts"][i].count("<r>")
        assert eps["lengths"][i] == eps["mask"][i].sum() <= 32
    assert eps["info"]["tool_calls"] == sum(t.count("<r>") for t in eps["transcripts"])


def _model_runs(tok, ids, model_mask):
    """Decoded texts of the maximal runs of model tokens (one per turn)."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), model_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def _obs_lengths(transcript):
    import re
    return re.findall(r"<r>(\d+)</r>", transcript)


@pytest.mark.parametrize("engine", [None, episodes.EngineOptions(slots=5, chunk_steps=3)])
def test_episode_routes_are_the_training_forwards(char_model, engine):
    """Routing replay on episodes (static turn batches, or the episode engine with slots
    reused): the recorded experts of every token fed to the cache (prompt, model and
    observation tokens), laid out as the training row's columns, are the sets a full forward
    over prompt ++ trajectory routes them to (replaying such routes gives the sampler's
    log-probs: tests/test_moe.py)."""
    tok, _, _ = char_model
    cfg = models.get_preset("tiny-moe", init_std=0.1, vocab_size=tok.vocab_size, num_layers=1,
                            hidden_size=32, num_heads=2, num_kv_heads=1,
                            moe_intermediate_size=16)
    params = models.init_params(cfg, jax.random.key(4))
    params = dict(params, lm_head=params["lm_head"] * 2.0)
    eps = _run((tok, cfg, params), record_routes=True, engine=engine)
    p = eps["prompt_len"]
    pt, pm = sampling.pad_to_bucket(eps["prompt_ids"], pad_id=0, buckets=(p,))
    tokens = np.concatenate([pt, eps["tokens"]], 1)
    mask = np.concatenate([pm, eps["mask"]], 1)
    routes = eps["routes"]
    assert routes.shape == tokens.shape + (cfg.num_layers, cfg.num_experts_per_tok)
    assert (eps["mask"] & ~eps["model_mask"]).sum() > 5, "the episodes should hold observations"
    _, _, stats = models.trunk(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                               with_moe_stats=True)
    own = np.asarray(stats["ids"]).transpose(1, 2, 0, 3)          # [R, P+M, L, k]
    fed = mask.copy()
    fed[np.arange(len(fed)), p + eps["lengths"] - 1] = False      # the last token: never fed
    np.testing.assert_array_equal(np.sort(routes[fed], -1), np.sort(own[fed], -1))


def test_episodes_deterministic_and_seed_dependent(char_model):
    a, b, c = _run(char_model, seed=3), _run(char_model, seed=3), _run(char_model, seed=4)
    for k in ("tokens", "mask", "model_mask", "logps", "turns", "env_rewards"):
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["tokens"], c["tokens"])


def test_episode_budgets_truncate(char_model):
    """A 12-token budget or a 1-turn limit ends episodes without the environment's done."""
    eps = _run(char_model, max_total_tokens=12)
    assert eps["lengths"].max() <= 12
    one = _run(char_model, max_turns=1)
    assert np.all(one["turns"] == 1)
    np.testing.assert_array_equal(one["truncated"], ["c" in t for t in one["final_turns"]])


def test_chat_renderer_observation_chunk():
    tok = tokenizers.CharTokenizer()
    r = render.Renderer(tok, chat=True)
    assert r.prompt([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant: "
    assert r.observation([{"role": "tool", "content": "42"}], False) == \
        "\ntool: 42\nAssistant: "
    plain = render.Renderer(tok, chat=False)
    assert plain.observation([{"role": "tool", "content": "<r>4</r>"}], False) == "<r>4</r>"


def test_sharded_episodes_equal_unsharded(char_model):
    """The same episodes on a 2x2x2 mesh of 8 fake devices (rows over data x fsdp, cache heads
    over tensor, parameters sharded): same tokens, same log-probs."""
    from rljax import sharding
    tok, cfg, params = char_model
    ref = _run(char_model, seed=5)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    sparams = sharding.shard_params(params, shardings)
    envs = [CountingEnv({"q": q}) for q in ["12*3=", "7+8=", "90="] for _ in range(4)]
    limits = episodes.EpisodeLimits(turn_tokens=8, chunk_tokens=12, max_turns=3,
                                    max_total_tokens=32, prompt_buckets=(8,))
    out = episodes.run_episodes(cfg, sparams, tok, envs, limits=limits,
                                renderer=render.Renderer(tok, chat=False, call_end="</c>"),
                                rng=jax.random.key(5), num_samples=4, mesh=mesh)
    for k in ("tokens", "mask", "model_mask", "turns"):
        np.testing.assert_array_equal(out[k], ref[k])
    np.testing.assert_allclose(out["logps"], ref["logps"], atol=1e-5)
    assert sparams["layers"]["q"].sharding.spec == shardings["layers"]["q"].spec


@pytest.mark.parametrize("slots,chunk_steps", [(5, 3), (12, 16)])
def test_engine_episodes_equal_static(char_model, slots, chunk_steps):
    """Episodes on the slot engine (each on a slot of its own, observations fed token by token
    while other slots decode, 12 episodes through 5 slots) equal the static turn batches: same
    tokens and turns (each row draws its own noise), log-probs of a full forward."""
    tok, cfg, params = char_model
    ref = _run(char_model, seed=6)
    out = _run(char_model, seed=6,
               engine=episodes.EngineOptions(slots=slots, chunk_steps=chunk_steps))
    for k in ("tokens", "mask", "model_mask", "turn_ids", "turns", "env_rewards", "truncated"):
        np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
    np.testing.assert_allclose(out["logps"], ref["logps"], atol=2e-5, rtol=0)
    assert ref["turns"].max() >= 2 and out["transcripts"] == ref["transcripts"]
    busy, run = out["slot_steps"]
    assert 0 < busy <= run


def test_engine_episodes_resume_after_given_first_turns(char_model):
    """``first_turn`` (tree rollouts' leaves): every row's first turn given, the engine feeds
    each trajectory on a slot and plays the later turns; given the first turns the straight
    run sampled, the episodes equal it (a row's later turns draw the same noise)."""
    ref = _run(char_model, seed=6)
    first = np.where(ref["turn_ids"] == 0, ref["tokens"], 0)
    lengths = (ref["turn_ids"] == 0).sum(1)
    given = lambda p_tok, p_mask: (first, np.where(ref["turn_ids"] == 0, ref["logps"], 0),  # noqa
                                   lengths)
    out = _run(char_model, seed=6, engine=episodes.EngineOptions(slots=5, chunk_steps=3),
               first_turn=given)
    for k in ("tokens", "mask", "model_mask", "turn_ids", "turns", "env_rewards", "truncated"):
        np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
    np.testing.assert_allclose(out["logps"], ref["logps"], atol=2e-5, rtol=0)
    assert ref["turns"].max() >= 2 and out["slot_steps"][0] > 0
    # Under another seed the given first turns are still the episodes' first turns.
    other = _run(char_model, seed=7, engine=episodes.EngineOptions(slots=5, chunk_steps=3),
                 first_turn=given)
    np.testing.assert_array_equal(np.where(other["turn_ids"] == 0, other["tokens"], 0), first)
