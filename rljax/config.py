"""Experiment configuration: one ``ml_collections.ConfigDict`` schema, file loading, overrides.

``default_config()`` is the schema: every known key with its default, and the default's type is
the key's type. A config file is a ``.py`` whose ``get_config()`` returns a (possibly partial)
ConfigDict; it is laid over the defaults, then ``--config.a.b=value`` overrides are applied, then
``validate`` checks unknown keys, types and impossible combinations. All problems raise
``ConfigError`` naming the dotted key, before anything compiles.

Adding a knob means adding it to ``default_config()`` (with a comment); nothing else.
Sections listed in ``OPEN_SECTIONS`` are free-form dicts passed through to one component.

A few keys default to None meaning "the default of the chosen algorithm": ``algo.beta`` (per
phase, :data:`BETA_DEFAULTS`) and ``algo.epsilon`` / ``algo.epsilon_high`` (per policy loss,
:data:`POLICY_LOSS_DEFAULTS`). ``validate`` fills the unset ones in (``resolve_defaults``), so
the validated config, and the ``config.json`` a run writes, shows the values the run uses.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import math
import os
from typing import Any, Mapping, Sequence

import ml_collections
from ml_collections import config_dict

from rljax.errors import ConfigError

# Free-form dicts: any keys allowed below these paths (their owner validates them).
OPEN_SECTIONS = ("model.overrides", "data.kwargs", "reward.kwargs", "env.kwargs")

# Allowed names for string knobs chosen from a registry. The owning module may pass a fresher
# registry to ``validate(cfg, choices=...)``; these constants are the documented defaults.
CHOICES: dict[str, tuple[str, ...]] = {
    "algo.name": ("grpo", "ppo", "dpo", "sft", "rm"),
    "algo.adv_estimator": ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                           "reinforce_pp_seq", "reinforce_pp_baseline_seq", "gae", "treepo",
                           "rover"),
    "algo.kl_estimator": ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "k3+", "k3_st", "abs"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"),
    "algo.policy_loss": ("ppo", "vanilla", "gspo", "cispo"),
    "algo.loss_type": ("sigmoid", "ipo", "hinge", "robust", "simpo"),
    "algo.scale_rewards": ("group", "batch", "none"),
    "rollout.temperature_schedule.name": ("constant", "linear", "cosine", "exp"),
    "data.pairs": ("auto", "step_mc"),
    "data.selection.name": ("uniform", "online_filter", "predicted", "curriculum"),
    "algo.importance_sampling_level": ("token", "sequence"),
    "algo.hint.mode": ("off", "fixed", "adaptive"),
    "algo.hint.source": ("reference", "replay"),
    "algo.relift.prompts": ("failed", "any"),
    "optimizer.name": ("adamw", "adam", "sgd"),
    "optimizer.schedule": ("constant", "linear", "cosine"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "tokenizer.kind": ("auto", "hf", "sentencepiece", "char"),
    "memory.check": ("auto", "full", "off"),
    "reward.isolation": ("thread", "process"),
    "logging.wandb.mode": ("online", "offline", "disabled"),
    "compile_for": ("throughput", "startup"),
}

# Per-loss defaults of the clip keys left unset (None), as in each loss's signature
# (rljax.algorithms.policy_losses; tests/test_config.py checks they agree). A None here is the
# loss's own meaning of None: ppo's epsilon_high = epsilon (symmetric clip), cispo's
# epsilon = no lower bound (the paper's one-sided clip).
POLICY_LOSS_DEFAULTS: dict[str, dict[str, float | None]] = {
    "ppo": {"epsilon": 0.2, "epsilon_high": None},
    "vanilla": {"epsilon": 0.2, "epsilon_high": None},
    "gspo": {"epsilon": 3e-4, "epsilon_high": 4e-4},    # Zheng et al. 2025
    "cispo": {"epsilon": None, "epsilon_high": 0.28},   # MiniMax-M1
}

# ``algo.beta`` left unset: the phase's default. It is the KL-to-reference coefficient in GRPO
# and PPO (0.04, the GRPO paper's) and the inverse temperature of the implicit reward in DPO
# (0.1, the DPO paper's and TRL's usual value).
BETA_DEFAULTS: dict[str, float] = {"dpo": 0.1}
BETA_DEFAULT = 0.04

# Advantage estimators that normalise within a prompt's group, so they need G >= 2.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline",
                    "reinforce_pp_baseline_seq", "treepo", "rover")
# Outcome estimators that per-turn returns plug into (env.turn_discount; the same tuple as
# rljax.algorithms.turn_credit.TURN_ESTIMATORS, not imported: config loads without jax).
TURN_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# Advantage estimators over the sampled tree: they need rollout.tree.enabled.
TREE_ESTIMATORS = ("treepo", "rover")


def default_config() -> ml_collections.ConfigDict:
    """Returns the full schema: every known key with its default value (and so its type)."""
    # Optional floats: None = "off" or "derive from another key". One placeholder per field:
    # a shared FieldReference would tie the fields together.
    opt_float = lambda: config_dict.placeholder(float)  # noqa: E731
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100                    # RL (or SFT/DPO/RM) optimizer steps
    c.eval_every = 0                 # 0 = never (except the final eval)
    c.eval_at_start = False          # also evaluate the starting policy (step 0) of a fresh run
    c.checkpoint_every = 50          # 0 = only on stop/finish
    c.compilation_cache_dir = "auto"  # persistent XLA cache ("auto": ~/.cache/rljax/jax; "" = off)
    # "startup": XLA:CPU compiles ~2x faster, runs ~4% slower (rljax.compilation_cache)
    c.compile_for = "throughput"

    c.model = dict(
        preset="tiny",               # models.get_preset name; ignored when `path` is set
        path="",                     # HF dir (config.json + *.safetensors) or .gguf file to load
        dtype="float32",             # parameter dtype
        remat=False,                 # rematerialise layer activations in the update step
        overrides={},                # free-form ModelConfig overrides for the preset
        # LoRA (docs/lora.md): rank > 0 trains adapters on the frozen base; the base model
        # (adapters off) is then the reference policy. targets: projection names or regexes
        # out of q k v o gate up down.
        lora=dict(rank=0, alpha=16.0, dropout=0.0,
                  targets=("q", "k", "v", "o", "gate", "up", "down"),
                  # Rollouts and evals sample from the adapters merged into a float32 base
                  # once per call (W + scale * A @ B; a second copy of the weights while
                  # sampling) instead of two extra matmuls per projection per token: faster on
                  # SmolLM2-135M (CPU) and a 0.5B model (H100), docs/lora.md. A bf16/fp16 base
                  # is never merged (rounding would erase small adapter updates).
                  merge_for_sampling=True),
        adapter_path="",             # PEFT adapter dir to start from (implies LoRA)
    )
    c.tokenizer = dict(
        path="",                     # "" = model.path, or the built-in char tokenizer
        kind="auto",
        chat_template=False,         # wrap prompts with the tokenizer's chat template
    )
    c.data = dict(
        source="arithmetic",         # task name, "jsonl", "parquet" or "tfds:<name>"
        path="",                     # file for jsonl/parquet
        eval_path="",                # "" = same source, `eval_split`
        split="train",
        eval_split="test",
        template="plain",            # prompt template name
        max_prompt_length=256,
        shuffle=True,
        kwargs={},                   # free-form options for the source
        pairs="auto",                # DPO pairs: "auto" = the data's (offline) or best vs worst
                                     # of num_generations (algo.online); "step_mc" = step-level
                                     # pairs from Monte-Carlo step values (docs/search.md)
        step_delimiter="\n",         # step_mc: a solution's steps end with this text
        # Which prompts an RL step trains on (rljax.data.selection, docs/curricula.md):
        # uniform (as drawn), online_filter (groups with pass rate in [low, high]; more
        # sampling rounds, algo.max_sampling_rounds), predicted (MoPPS: Beta posteriors per
        # prompt, Thompson-sampled near `target`), curriculum (task knob `knob` moved to keep
        # the training accuracy in [low, high]). Success: reward >= threshold (fractional:
        # the reward clipped to [0, 1]).
        selection=dict(
            name="uniform",
            low=0.1,                 # band of pass rates (online_filter) / accuracy (curriculum)
            high=0.9,
            threshold=1.0,           # a sample succeeds when its reward >= threshold
            fractional=False,        # or counts min(max(reward, 0), 1) as its success
            target=0.5,              # predicted: success rate to pick prompts near
            pool_factor=4,           # predicted: candidates per step = pool_factor x prompts
            prior_a=1.0,             # predicted: Beta prior of every prompt
            prior_b=1.0,
            decay=0.9,               # predicted: evidence kept per update (1 = no forgetting)
            max_tracked=100_000,     # predicted: posteriors kept (least recent dropped)
            knob="digits",           # curriculum: the built-in task's difficulty knob
            min_level=1,             # curriculum: easiest level (training starts there)
            window=10,               # curriculum: steps between level decisions
        ),
    )
    c.rollout = dict(
        batch_size=16,               # completions per step = prompts * algo.num_generations
        max_new_tokens=128,
        temperature=1.0,
        top_k=0,                     # 0 = off
        top_p=1.0,
        micro_batch_size=0,          # sampler chunk; 0 = whole batch at once
        # Concurrent decode streams: the prompts (of each chunk) split this many ways, decoded
        # by concurrent programs; same samples as one stream. 0 = auto (2 on a CPU with 2+
        # cores and one device, else 1; rljax.streams).
        streams=0,
        # Per-position sampling temperature (exploratory annealed decoding; docs/search.md):
        # from `start` at the first completion token to `end` at token `tokens` (0 = all of
        # max_new_tokens), then `end`. "constant" = off (rollout.temperature everywhere);
        # otherwise it replaces rollout.temperature for rollouts, and training log-probs and
        # ratios use each token's own temperature. GRPO and online DPO only.
        temperature_schedule=dict(name="constant", start=1.0, end=1.0, tokens=0),
        # Tree sampling (docs/search.md; rljax.tree_sampling): each prompt's group of
        # algo.num_generations completions is the leaves of one tree: `roots` paths decode
        # `segment_tokens` tokens, then every path forks into `branching` children sharing its
        # KV cache, depth times, until roots * branching**depth = max_leaves leaves; the
        # leaves decode the rest. Shared segments are decoded once.
        tree=dict(
            enabled=False,
            segment_tokens=2,        # L, tokens per segment before each fork
            branching=2,             # k, children per path at each fork
            roots=1,                 # independent paths per prompt before the first fork
            max_leaves=0,            # leaves per prompt; 0 = algo.num_generations (must agree)
        ),
    )
    c.algo = dict(
        name="grpo",
        num_generations=4,           # G completions per prompt
        beta=opt_float(),            # GRPO/PPO: KL-to-reference coefficient (0 = no
                                     # reference); DPO: inverse temperature of the implicit
                                     # reward. None = the phase's default: 0.04 (grpo, ppo),
                                     # 0.1 (dpo); see BETA_DEFAULTS
        epsilon=opt_float(),         # lower clip: ratio >= 1 - epsilon. None = the policy
                                     # loss's default: 0.2 (ppo), 3e-4 (gspo), none (cispo)
        epsilon_high=opt_float(),    # upper clip (DAPO clip-higher). None = the policy loss's
                                     # default: = epsilon (ppo), 4e-4 (gspo), 0.28 (cispo)
        clip_ratio_c=opt_float(),    # dual-clip bound (> 1) for negative advantages; None = off
        tis_cap=opt_float(),         # truncated importance sampling vs sampler logps; None = off
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        adv_estimator="grpo",        # grpo, dr_grpo, rloo (one advantage per completion);
                                     # reinforce_pp, reinforce_pp_baseline (per token, whitened
                                     # over the batch's tokens, as the paper); *_seq variants:
                                     # one per completion, whitened over completions
        kl_estimator="k3",
        kl_in_reward=False,          # subtract beta*KL from the reward instead of the loss:
                                     # per token for token-level estimators (and PPO), the
                                     # completion's total KL for per-completion ones
        scale_rewards="group",       # divide advantages by the std of: group, batch, none
        num_iterations=1,            # update epochs per rollout batch (mu)
        mini_batch_size=0,           # completions per optimizer step; 0 = whole batch
        micro_batch_size=0,          # completions per forward/backward; 0 = mini batch
        group_by_length=False,       # GRPO: micro-batches of rows of similar length, each
                                     # computed on its own real columns only (exact up to
                                     # float32 order; rljax.train.length_groups)
        shared_prompt=True,          # GRPO: the update computes each group's prompt once, its
                                     # G completions attending to it (exact up to float32
                                     # order; rljax.models.shared_prompt); other algorithms
                                     # ignore it
        update_streams=0,            # GRPO with group_by_length or shared_prompt: each
                                     # micro-batch's gradients in this many parts computed
                                     # concurrently (rljax.streams; exact up to float32
                                     # order). 0 = auto (2 on a CPU with 2+ cores, else 1)
        importance_sampling_level="token",
        mask_truncated_completions=False,
        dynamic_sampling=False,      # DAPO: drop groups with all-equal rewards, sample more
        max_sampling_rounds=3,       # extra sampling rounds per step for dynamic_sampling
        overlong_buffer=0,           # DAPO soft overlong penalty over the last N tokens; 0 = off
        overlong_penalty_factor=1.0,  # scale of that penalty (-factor at max_new_tokens)
        entropy_coef=0.0,
        gamma=1.0,                   # discount of PPO/GAE and the REINFORCE++ return
        lam=0.95,                    # GAE lambda
        vf_coef=0.5,                 # value loss weight (PPO)
        cliprange_value=0.2,         # value clipping (PPO); 0 = off
        loss_type="sigmoid",         # DPO loss variant
        label_smoothing=0.0,         # DPO conservative label smoothing
        whiten_advantages=True,      # PPO: whiten GAE advantages over the rollout batch
        online=False,                # DPO: pairs from the policy's own samples (best vs worst
                                     # of num_generations, ranked by reward) instead of data
        ref_update_every=0,          # DPO/PPO: copy the policy into the reference every N
                                     # steps (online DPO: 1 = refresh each round); 0 = frozen
        # data.pairs="step_mc": one sampled solution per prompt is cut into steps; each step
        # prefix (up to max_steps of them) gets num_generations continuations, whose mean
        # reward values the candidate next steps; the best and worst next step at a prefix
        # form a pair when their values differ by more than min_value_gap.
        step_mc=dict(max_steps=4, min_value_gap=0.0),
        # Guidance for prompts the policy fails (GRPO; docs/guidance.md). Reference solutions:
        # built-in tasks' task.solution; files: this column ("" = the first of completion,
        # solution, answer).
        solution_field="",
        hint=dict(                   # re-sample a group whose G samples all failed with a
                                     # solution prefix as context (only the continuation trains)
            mode="off",              # off | fixed (GHPO) | adaptive (SEELE, per prompt)
            source="reference",      # reference (dataset solution) | replay (a stored success
                                     # of the same prompt: POPE / off-policy prefixes)
            threshold=1.0,           # a sample succeeds when its reward >= threshold (also
                                     # the failure test of relift and mixed_policy)
            fraction=0.5,            # share of the solution's tokens given (adaptive: start)
            target=0.5,              # adaptive: success rate of hinted groups to steer toward
            step=0.25,               # adaptive: fraction += step * (target - success rate)
            min_fraction=0.0,        # adaptive: bounds of the per-prompt fraction
            max_fraction=1.0,
            replay_fallback=True,    # replay: no stored success -> the reference (else no hint)
            max_prompts=10000,       # per-prompt state kept (oldest dropped)
        ),
        relift=dict(                 # ReLIFT: SFT on prompts the policy keeps failing
            every=0,                 # one SFT step every N RL steps; 0 = off
            k_visits=1,              # buffered after this many zero-success visits in a row
            batch_size=16,           # prompts per SFT step (padded rows count for nothing)
            buffer_size=256,         # FIFO bound of the buffer (deduplicated by prompt)
            coef=1.0,                # SFT loss scale (the mixing weight next to RL updates)
            prompts="failed",        # failed: ReLIFT. any: every visited prompt is buffered,
                                     # solved or not (a control: the same SFT steps on
                                     # prompts not chosen by failure)
        ),
        mixed_policy=False,          # LUFFY-style: the reference solution replaces one sample
                                     # of a group that failed entirely (importance ratio
                                     # pi_theta / 1, so <= 1); an alternative to hints
    )
    c.optimizer = dict(
        name="adamw",
        learning_rate=1e-6,
        critic_learning_rate=opt_float(),  # None = learning_rate
        schedule="constant",
        warmup_steps=0,
        min_lr_ratio=0.0,            # end of linear/cosine decay, as a fraction of the peak
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        momentum=0.0,                # sgd only
        weight_decay=0.0,            # decoupled for adamw, L2 for adam/sgd; skips norms/biases
        max_grad_norm=1.0,           # global-norm clipping; 0 = off
        max_consecutive_nonfinite=5,  # stop after this many skipped (non-finite) steps in a row
    )
    c.reward = dict(
        names=("arithmetic",),       # rewards.get names, summed with `weights`
        weights=(),                  # () = all 1.0
        model_path="",               # reward-model checkpoint for the "model" reward
        kwargs={},                   # free-form options: {function name: {option: value}}
        default_score=0.0,           # score of a sample its function failed on (error/NaN/timeout)
        timeout_s=30.0,              # per batch; 0 = none (calls run on the main thread)
        isolation="thread",          # "thread": a hung call is abandoned (counted, cannot be
                                     # killed); "process": spawned workers, killed on timeout
        max_consecutive_error_steps=10,  # stop when a function fails on every sample of this
                                         # many steps in a row; 0 = never
    )
    c.env = dict(                    # multi-turn episodes (docs/agents.md); "" = single-turn
        name="",                     # environment: "tool", "guess_number", path/to/file.py:fn
        tools=(),                    # tool names for the "tool" environment (calculator, ...)
        tool_format="plain",         # how calls are written: "plain" or "json" (chat template)
        max_turns=4,                 # model turns per episode
        max_total_tokens=128,        # trajectory tokens after the prompt (model + observations)
        max_turn_tokens=0,           # tokens per model turn; 0 = rollout.max_new_tokens
        max_obs_tokens=31,           # tokens of one rendered observation (longer: the episode
                                     # ends, truncated); the cache holds O = this + 1 per turn
        kwargs={},                   # free-form options of the environment's factory
        turn_discount=opt_float(),   # None = outcome: the episode's summed reward for every
                                     # turn; gamma in [0, 1] = per-turn rewards, turn t judged
                                     # by sum_k gamma^k r_{t+k} (docs/agents.md)
    )
    c.mesh = dict(data=-1, fsdp=1, tensor=1)  # -1 = the rest of the devices
    c.logging = dict(
        log_every=1,
        console_every_s=10.0,        # console progress line at most this often
        tensorboard=True,
        num_completions_to_print=0,
        wandb=dict(                  # Weights & Biases; off while project is ""
            project="",
            mode="online",           # "online", "offline" (files under WORKDIR/wandb, no
                                     # network; `wandb sync` later) or "disabled"
            entity="",
            name="",                 # "" = the workdir's name
            tags=(),
        ),
    )
    c.sft = dict(
        steps=0,                     # warm-up SFT steps before RL; 0 = none
        learning_rate=1e-5,
        batch_size=16,
        max_length=512,
        source="",                   # "" = data.source
        path="",
        env_traces=False,            # with env.name: train on the environment's scripted
                                     # episodes (tool calls, observations as context)
        trace_noise=0.0,             # guess_number traces: chance that a guess is random in
                                     # the interval left instead of the midpoint
    )
    c.memory = dict(
        check="auto",                # pre-flight memory check in `train` (rljax.plan): "full"
                                     # compiles every phase; "auto" = full on GPU/TPU or when
                                     # device_memory_gb is set, else resident state only; "off"
        device_memory_gb=0.0,        # per-device memory to plan against; 0 = ask the device
    )
    c.checkpoint = dict(
        max_to_keep=3,
        async_save=True,
        save_on_stop=True,           # save when stopped by SIGTERM/SIGINT
        fallback_on_damage=True,     # a damaged latest checkpoint: move it aside, resume from
                                     # the newest readable one (False: stop with an error)
    )
    c.eval = dict(
        num_examples=256,            # 0 = the whole split
        batch_size=64,
        num_samples=1,               # samples per prompt; pass@k for k <= num_samples
        temperature=0.0,
        max_new_tokens=config_dict.placeholder(int),  # None = rollout.max_new_tokens
    )
    return c


# ----------------------------------------------------------------------------- loading

def load_config(path: str | None, overrides: Sequence[str] = (),
                choices: Mapping[str, Sequence[str]] | None = None) -> ml_collections.ConfigDict:
    """Loads ``path`` (``file.py`` or ``file.py:arg``) over the defaults, applies overrides.

    ``overrides`` are ``--config.a.b=value`` strings (the ``--config.`` prefix is optional).
    ``path=None`` starts from the defaults. Returns a validated ConfigDict.
    """
    cfg = default_config()
    if path:
        merge_into(cfg, config_from_file(path))
    apply_overrides(cfg, overrides)
    validate(cfg, choices=choices)
    return cfg


def json_loads(text: str, path: str) -> Any:
    """``json.loads(text)``; a file nesting deeper than the parser can follow (a
    RecursionError, thousands of levels) is one ConfigError naming ``path``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path} nests too deeply to be a config (corrupt or "
                          "hand-edited?)") from None


def load_config_json(path: str, overrides: Sequence[str] = (),
                     choices: Mapping[str, Sequence[str]] | None = None):
    """Loads a ``config.json`` written by :func:`to_json` (e.g. a workdir's) plus overrides."""
    try:
        with open(path) as f:
            data = json_loads(f.read(), path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    cfg = default_config()
    merge_into(cfg, data)
    apply_overrides(cfg, overrides)
    validate(cfg, choices=choices)
    return cfg


def to_json(cfg: ml_collections.ConfigDict) -> str:
    """Serialises a config (placeholders become ``null``); inverse of :func:`load_config_json`."""
    return cfg.to_json(indent=2, sort_keys=True)


def config_from_file(spec: str) -> Any:
    """Imports ``file.py`` and returns its ``get_config()`` (``file.py:arg`` passes ``arg``).

    Config files build on each other with it: a variant loads its base and changes a few keys.
    """
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    if path.endswith(".json"):
        with open(path) as f:
            return json_loads(f.read(), path)
    module_spec = importlib.util.spec_from_file_location("_rljax_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config() function")
    return module.get_config(arg) if arg else module.get_config()


def _as_dict(value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
        return value.to_dict()
    return value


def merge_into(cfg: ml_collections.ConfigDict, update: Any, prefix: str = "") -> None:
    """Lays ``update`` (dict or ConfigDict) over ``cfg``, checking keys and types as it goes."""
    update = _as_dict(update)
    if not isinstance(update, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a dict of keys, got {type(update).__name__}")
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if _is_open(dotted) or _is_open(prefix.rstrip(".")):
            cfg[key] = value
        elif key not in cfg:
            raise ConfigError(unknown_key_message(dotted, cfg.keys()))
        elif isinstance(cfg[key], ml_collections.ConfigDict):
            merge_into(cfg[key], value, dotted + ".")
        else:
            cfg[key] = coerce(dotted, value, _field_type(cfg, key), _nullable(dotted))


# ----------------------------------------------------------------------------- overrides

def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
    """Applies ``[--config.]a.b=value`` strings; the value is parsed by the key's type."""
    for item in overrides:
        text = item[len("--config."):] if item.startswith("--config.") else item
        key, eq, raw = text.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r} has no '=value'")
        parent, name = _resolve_parent(cfg, key)
        if _is_open(key.rpartition(".")[0]) or _is_open(key):
            value = _literal(raw)
            try:
                parent[name] = value
            except TypeError:  # ConfigDict keeps an existing key's type
                kind = type(parent[name]).__name__
                raise ConfigError(f"{key}: expected {kind}, got {type(value).__name__} "
                                  f"({value!r})") from None
            continue
        if isinstance(parent[name], ml_collections.ConfigDict):
            raise ConfigError(f"{key} is a section; override its keys, e.g. {key}.<name>=...")
        kind = _field_type(parent, name)
        parent[name] = coerce(key, parse_value(key, raw, kind), kind, _nullable(key))


def _resolve_parent(cfg: ml_collections.ConfigDict, dotted: str):
    """Walks to the ConfigDict holding ``dotted``'s last part; unknown parts raise ConfigError."""
    parts = dotted.split(".")
    node, path = cfg, []
    for part in parts[:-1]:
        path.append(part)
        if _is_open(".".join(path)):
            if part not in node:  # a new entry of a free-form section: reward.kwargs.NAME.k=v
                node[part] = ml_collections.ConfigDict()
            if not isinstance(node[part], ml_collections.ConfigDict):
                raise ConfigError(f"{'.'.join(path)}={node[part]!r} is not a section; cannot "
                                  f"set {dotted}")
            node = node[part]
            continue
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ConfigError(unknown_key_message(".".join(path), node.keys()))
        node = node[part]
    if parts[-1] not in node and not _is_open(".".join(parts[:-1])):
        raise ConfigError(unknown_key_message(dotted, node.keys()))
    return node, parts[-1]


def parse_value(key: str, raw: str, kind: type | None) -> Any:
    """Parses an override string the way its default's type says (bools accept true/false/1/0)."""
    if kind is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {raw!r}")
    if kind is str:
        return raw
    if kind in (tuple, list):
        value = _literal(raw)
        if isinstance(value, (tuple, list)):
            return tuple(value)
        if isinstance(value, str) and "," in value:
            return tuple(s.strip() for s in value.split(",") if s.strip())
        return () if raw.strip() == "" else (value,)
    if raw.strip().lower() in ("none", "null"):
        return None
    return _literal(raw)


def _literal(raw: str) -> Any:
    """Python literal if it parses (``3``, ``1e-6``, ``(1, 2)``), else the raw string."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


# ----------------------------------------------------------------------------- types

def _field_type(node: ml_collections.ConfigDict, key: str) -> type | None:
    return node.get_type(key)


def coerce(key: str, value: Any, kind: type | None, nullable: bool = False) -> Any:
    """Checks ``value`` against the schema type; ints widen to float, lists become tuples.

    ``None`` is accepted only where the default is ``None`` (``nullable``: a placeholder).
    """
    if value is None:
        if nullable or kind is None:
            return None
        raise ConfigError(f"{key}: expected {kind.__name__}, got None")
    if kind is None or kind is type(None):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        # json reads Infinity / NaN; NaN passes every range check (comparisons are False)
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (tuple, list) and isinstance(value, (tuple, list)):
        return tuple(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__} "
                          f"({value!r})")
    return value


def _nullable(dotted: str) -> bool:
    """True if the schema's default for ``dotted`` is None (a typed placeholder)."""
    try:
        return _get(default_config(), dotted) is None
    except (KeyError, AttributeError):
        return False


def _is_open(dotted: str) -> bool:
    return any(dotted == s or dotted.startswith(s + ".") for s in OPEN_SECTIONS)


def unknown_key_message(dotted: str, siblings) -> str:
    """'unknown config key a.bx (did you mean a.b?)', looking at siblings, then anywhere."""
    prefix, _, name = dotted.rpartition(".")
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.7)
    if close:
        hint = f"{prefix}.{close[0]}" if prefix else close[0]
    else:
        everywhere = _all_keys(default_config())
        same_name = [k for k in everywhere if k.rpartition(".")[2] == name]
        close = same_name or difflib.get_close_matches(dotted, everywhere, n=1, cutoff=0.6)
        hint = close[0] if close else None
    msg = f"unknown config key '{dotted}'"
    return f"{msg} (did you mean '{hint}'?)" if hint else msg


def _all_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key in cfg.keys():
        dotted = prefix + key
        keys.append(dotted)
        if isinstance(cfg[key], ml_collections.ConfigDict) and not _is_open(dotted):
            keys.extend(_all_keys(cfg[key], dotted + "."))
    return keys


# ----------------------------------------------------------------------------- validation

def validate(cfg: ml_collections.ConfigDict,
             choices: Mapping[str, Sequence[str]] | None = None) -> ml_collections.ConfigDict:
    """Raises ConfigError for unknown/missing keys, wrong types, bad names or impossible combos.

    ``choices`` maps dotted keys to allowed names, overriding/extending :data:`CHOICES` (so a
    module's live registry can be passed in). Returns ``cfg`` for chaining.
    """
    _check_schema(cfg, default_config(), "")
    for key, names in {**CHOICES, **(choices or {})}.items():
        value = _get(cfg, key)
        if value not in tuple(names):
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, names))}")
    filled = resolve_defaults(cfg)
    _check_ranges(cfg)
    _check_combinations(cfg, filled)
    return cfg


def resolve_defaults(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Fills the algorithm-dependent keys left at None, in place: ``algo.beta`` from
    :data:`BETA_DEFAULTS` (by ``algo.name``), ``algo.epsilon`` / ``algo.epsilon_high`` from
    :data:`POLICY_LOSS_DEFAULTS` (by ``algo.policy_loss``; a loss not in the table keeps None,
    which leaves the loss function's own default). Keys the user set are never changed.
    Idempotent. Returns ``{dotted key: value filled in}``."""
    algo, filled = cfg.algo, {}
    if algo.beta is None:
        algo.beta = filled["algo.beta"] = BETA_DEFAULTS.get(algo.name, BETA_DEFAULT)
    for key, value in POLICY_LOSS_DEFAULTS.get(algo.policy_loss, {}).items():
        if algo[key] is None and value is not None:
            algo[key] = filled[f"algo.{key}"] = value
    return filled


def _get(cfg: ml_collections.ConfigDict, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _check_schema(cfg, schema, prefix: str) -> None:
    """Every key of ``cfg`` exists in ``schema`` with a compatible type, and none is missing."""
    for key in cfg.keys():
        dotted = prefix + key
        if _is_open(dotted):
            continue
        if key not in schema:
            raise ConfigError(unknown_key_message(dotted, schema.keys()))
        value = cfg[key]
        if isinstance(schema[key], ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"{dotted}: expected a section (dict), got {value!r}")
            _check_schema(value, schema[key], dotted + ".")
        else:
            coerce(dotted, value, schema.get_type(key), schema[key] is None)
    missing = [k for k in schema.keys() if k not in cfg]
    if missing:
        raise ConfigError(f"config key '{prefix}{missing[0]}' is missing")


# (key, lowest allowed, highest allowed); None = unbounded.
_RANGES = (
    ("steps", 1, None), ("eval_every", 0, None), ("checkpoint_every", 0, None),
    ("data.max_prompt_length", 1, None),
    ("rollout.batch_size", 1, None), ("rollout.max_new_tokens", 1, None),
    ("rollout.temperature", 0.0, None), ("rollout.top_k", 0, None), ("rollout.top_p", 1e-9, 1.0),
    ("rollout.micro_batch_size", 0, None), ("rollout.streams", 0, None),
    ("algo.update_streams", 0, None),
    ("rollout.tree.segment_tokens", 1, None), ("rollout.tree.branching", 1, None),
    ("rollout.tree.roots", 1, None), ("rollout.tree.max_leaves", 0, None),
    ("algo.num_generations", 1, None), ("algo.beta", 0.0, None),
    ("algo.num_iterations", 1, None),
    ("algo.mini_batch_size", 0, None), ("algo.micro_batch_size", 0, None),
    ("algo.entropy_coef", 0.0, None), ("algo.max_sampling_rounds", 0, None),
    ("algo.overlong_buffer", 0, None), ("algo.overlong_penalty_factor", 0.0, None), ("algo.gamma", 0.0, 1.0), ("algo.lam", 0.0, 1.0),
    ("algo.vf_coef", 0.0, None), ("algo.cliprange_value", 0.0, None),
    ("algo.label_smoothing", 0.0, 0.5), ("algo.ref_update_every", 0, None),
    ("memory.device_memory_gb", 0.0, None),
    ("algo.hint.fraction", 0.0, 1.0), ("algo.hint.target", 0.0, 1.0),
    ("algo.hint.min_fraction", 0.0, 1.0), ("algo.hint.max_fraction", 0.0, 1.0),
    ("algo.hint.step", 0.0, None), ("algo.hint.max_prompts", 1, None),
    ("algo.relift.every", 0, None), ("algo.relift.k_visits", 1, None),
    ("algo.relift.batch_size", 1, None), ("algo.relift.buffer_size", 1, None),
    ("algo.relift.coef", 0.0, None),
    ("optimizer.learning_rate", 1e-30, None), ("optimizer.warmup_steps", 0, None),
    ("optimizer.min_lr_ratio", 0.0, 1.0), ("optimizer.weight_decay", 0.0, None),
    ("optimizer.max_grad_norm", 0.0, None), ("optimizer.max_consecutive_nonfinite", 1, None),
    ("logging.log_every", 1, None), ("logging.console_every_s", 0.0, None),
    ("logging.num_completions_to_print", 0, None),
    ("sft.steps", 0, None), ("sft.learning_rate", 1e-30, None), ("sft.batch_size", 1, None),
    ("sft.max_length", 1, None), ("sft.trace_noise", 0.0, 1.0),
    ("checkpoint.max_to_keep", 1, None),
    ("eval.num_examples", 0, None), ("eval.batch_size", 1, None), ("eval.num_samples", 1, None),
    ("eval.temperature", 0.0, None),
    ("reward.timeout_s", 0.0, None), ("reward.max_consecutive_error_steps", 0, None),
    ("env.max_turns", 1, None), ("env.max_total_tokens", 1, None), ("env.max_turn_tokens", 0, None),
    ("env.max_obs_tokens", 1, None),
    ("data.selection.low", 0.0, 1.0), ("data.selection.high", 0.0, 1.0),
    ("data.selection.target", 0.0, 1.0), ("data.selection.pool_factor", 1, None),
    ("data.selection.prior_a", 1e-9, None), ("data.selection.prior_b", 1e-9, None),
    ("data.selection.decay", 1e-9, 1.0), ("data.selection.max_tracked", 1, None),
    ("data.selection.window", 1, None),
)


def _check_ranges(cfg) -> None:
    for key, low, high in _RANGES:
        value = _get(cfg, key)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{key}={value!r} must be {bounds}")
    for key, low in (("optimizer.critic_learning_rate", 0), ("eval.max_new_tokens", 0),
                     ("algo.clip_ratio_c", 1), ("algo.tis_cap", 0)):
        value = _get(cfg, key)
        if value is not None and value <= low:
            raise ConfigError(f"{key}={value!r} must be > {low} (or None for off/default)")
    for key in ("algo.epsilon", "algo.epsilon_high"):
        value = _get(cfg, key)
        if value is not None and value < 0:
            raise ConfigError(f"{key}={value!r} must be >= 0 (or None for the loss's default)")


def _check_combinations(cfg, filled: Mapping[str, Any] | None = None) -> None:
    """Cross-key constraints: each message names the keys involved and how to fix them."""
    algo, rollout = cfg.algo, cfg.rollout
    g, batch = algo.num_generations, rollout.batch_size
    mini = algo.mini_batch_size or batch
    sizes = [  # (dividend key, value, divisor key, value, note): all reported at once
        ("rollout.batch_size", batch, "algo.num_generations", g, " (batch_size counts completions)"),
        ("rollout.batch_size", batch, "algo.mini_batch_size", mini, ""),
        ("algo.mini_batch_size", mini, "algo.micro_batch_size", algo.micro_batch_size, ""),
        ("rollout.batch_size", batch, "rollout.micro_batch_size", rollout.micro_batch_size, ""),
    ]
    problems = [f"{a}={x} is not divisible by {b}={y}{note}"
                for a, x, b, y, note in sizes if y and x % y]
    if problems:
        raise ConfigError("; ".join(problems))
    if algo.name == "grpo" and algo.adv_estimator in GROUP_ESTIMATORS and g < 2:
        raise ConfigError(f"algo.num_generations={g} must be >= 2 for "
                          f"algo.adv_estimator='{algo.adv_estimator}' (it normalises per group)")
    if (algo.epsilon_high is not None and algo.epsilon is not None
            and algo.epsilon_high < algo.epsilon):
        unset = [k for k in ("algo.epsilon", "algo.epsilon_high") if k in (filled or {})]
        hint = (f" ({' and '.join(unset)} not set: policy_loss='{algo.policy_loss}' default; "
                "set both)" if unset else "")
        raise ConfigError(f"algo.epsilon_high={algo.epsilon_high} must be >= "
                          f"algo.epsilon={algo.epsilon}{hint}")
    if algo.name == "dpo" and algo.online and g < 2:
        raise ConfigError(f"algo.num_generations={g} must be >= 2 for online DPO "
                          "(algo.online=True pairs the best and worst sample of each prompt)")
    _check_step_mc(cfg)
    _check_temperature_schedule(cfg)
    if algo.adv_estimator == "gae" and algo.name != "ppo":
        raise ConfigError("algo.adv_estimator='gae' needs a critic: set algo.name='ppo'")
    if algo.name == "ppo" and algo.adv_estimator != "gae":
        raise ConfigError("algo.name='ppo' trains a critic for GAE: set algo.adv_estimator='gae'")
    if algo.group_by_length and algo.name != "grpo":
        raise ConfigError(f"algo.group_by_length=True groups the GRPO update's micro-batches; "
                          f"algo.name='{algo.name}' does not use it (set it to False)")
    _check_guidance(cfg)
    _check_tree(cfg)
    _check_mesh(cfg.mesh)
    if cfg.reward.weights and len(cfg.reward.weights) != len(cfg.reward.names):
        raise ConfigError(f"reward.weights has {len(cfg.reward.weights)} entries but "
                          f"reward.names has {len(cfg.reward.names)}")
    if cfg.data.source in ("jsonl", "parquet") and not cfg.data.path:
        raise ConfigError(f"data.path is required when data.source='{cfg.data.source}'")
    if algo.overlong_buffer > rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer={algo.overlong_buffer} must be <= "
                          f"rollout.max_new_tokens={rollout.max_new_tokens}")
    lora = cfg.model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank} must be > 0 (0 = LoRA off)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1) (the "
                          "probability of dropping an adapter input; 0 = off)")
    if (lora.rank or cfg.model.adapter_path) and lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be > 0")
    if (lora.rank or cfg.model.adapter_path) and algo.ref_update_every:
        raise ConfigError(f"algo.ref_update_every={algo.ref_update_every} refreshes a copied "
                          "reference; with LoRA (model.lora.rank > 0) the reference is the "
                          "frozen base model: set it to 0")
    _check_env(cfg)
    _check_selection(cfg)
    if cfg.eval.num_samples > 1 and cfg.eval.temperature == 0.0:
        raise ConfigError(f"eval.num_samples={cfg.eval.num_samples} needs eval.temperature > 0 "
                          "(greedy samples are all identical)")


def _check_temperature_schedule(cfg) -> None:
    """A schedule's temperatures are all > 0 and it runs where training scores tokens at it."""
    sched = cfg.rollout.temperature_schedule
    for key in ("start", "end"):
        if sched[key] <= 0:
            raise ConfigError(f"rollout.temperature_schedule.{key}={sched[key]!r} must be > 0 "
                              "(a schedule has no greedy position)")
    if sched.tokens < 0:
        raise ConfigError(f"rollout.temperature_schedule.tokens={sched.tokens} must be >= 0 "
                          "(0 = rollout.max_new_tokens)")
    if sched.name == "exp" and sched.start < sched.end:
        raise ConfigError(f"rollout.temperature_schedule: name='exp' anneals down, needs "
                          f"start >= end (got start={sched.start}, end={sched.end})")
    if sched.name != "constant" and cfg.algo.name not in ("grpo", "dpo"):
        raise ConfigError(f"rollout.temperature_schedule.name='{sched.name}' is supported for "
                          f"algo.name='grpo' and online 'dpo', not '{cfg.algo.name}'")


def _check_step_mc(cfg) -> None:
    """Step-level MC pairs are built from the policy's own samples by the DPO phase."""
    algo = cfg.algo
    if algo.step_mc.max_steps < 1:
        raise ConfigError(f"algo.step_mc.max_steps={algo.step_mc.max_steps} must be >= 1")
    if algo.step_mc.min_value_gap < 0:
        raise ConfigError(f"algo.step_mc.min_value_gap={algo.step_mc.min_value_gap} must be >= 0")
    if cfg.data.pairs != "step_mc":
        return
    if algo.name != "dpo" or not algo.online:
        raise ConfigError("data.pairs='step_mc' samples its pairs: set algo.name='dpo' and "
                          "algo.online=True")
    if not cfg.data.step_delimiter:
        raise ConfigError("data.step_delimiter must not be empty with data.pairs='step_mc'")
    if cfg.rollout.temperature_schedule.name != "constant":
        raise ConfigError("data.pairs='step_mc' samples continuations at rollout.temperature; "
                          "set rollout.temperature_schedule.name='constant'")


def _check_env(cfg) -> None:
    """The ``env`` section: known environment/tools/format (``envs.check_env_config``, which
    imports user code), an algorithm that samples episodes, and a chat template for ``json``."""
    env = cfg.env
    if cfg.sft.trace_noise and not (cfg.sft.env_traces and env.name == "guess_number"):
        raise ConfigError(f"sft.trace_noise={cfg.sft.trace_noise} applies to "
                          "env.name='guess_number' with sft.env_traces=True")
    if not env.name:
        if cfg.sft.env_traces:
            raise ConfigError("sft.env_traces=True needs an environment (env.name)")
        if env.turn_discount is not None:
            raise ConfigError("env.turn_discount needs multi-turn episodes (env.name)")
        return
    from rljax.envs import check_env_config   # host-only module; imported when used

    if cfg.rollout.temperature_schedule.name != "constant":
        raise ConfigError("rollout.temperature_schedule is not supported with multi-turn "
                          f"episodes (env.name={env.name!r}): set its name='constant'")

    check_env_config(env.name, tuple(env.tools), env.tool_format)
    if cfg.algo.name not in ("grpo", "ppo"):
        raise ConfigError(f"env.name={env.name!r}: multi-turn episodes train with "
                          f"algo.name='grpo' or 'ppo' (got {cfg.algo.name!r})")
    _check_turn_discount(cfg)
    if env.tool_format == "json" and env.tools and not cfg.tokenizer.chat_template:
        raise ConfigError("env.tool_format='json' renders tool results with the chat "
                          "template: set tokenizer.chat_template=True (or env.tool_format="
                          "'plain')")
    if cfg.sft.env_traces and env.name not in ENV_TRACES:
        raise ConfigError(f"sft.env_traces: environment {env.name!r} has no scripted traces "
                          f"(known: {', '.join(ENV_TRACES)})")


def _check_turn_discount(cfg) -> None:
    """``env.turn_discount``: in [0, 1]; with GRPO an estimator with a group baseline
    (``algorithms.turn_credit.TURN_ESTIMATORS``) and no sequence KL folded into the reward."""
    gamma, algo = cfg.env.turn_discount, cfg.algo
    if gamma is None:
        return
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"env.turn_discount={gamma!r} must be in [0, 1] (or None: outcome)")
    if algo.name == "grpo" and algo.adv_estimator not in TURN_ESTIMATORS:
        raise ConfigError(f"env.turn_discount (per-turn returns) needs algo.adv_estimator in "
                          f"{TURN_ESTIMATORS}, got '{algo.adv_estimator}'")
    if algo.name == "grpo" and algo.kl_in_reward and algo.beta > 0:
        raise ConfigError("env.turn_discount: algo.kl_in_reward=True (a sequence KL off the "
                          "outcome) is not supported with per-turn returns in GRPO; use the "
                          "KL loss (kl_in_reward=False) or algo.name='ppo'")


# Environments with scripted episodes for SFT warm-up (``sft.env_traces``).
ENV_TRACES = ("tool", "guess_number")


def _check_guidance(cfg) -> None:
    """Hints and ReLIFT (``algo.hint``, ``algo.relift``) are GRPO options."""
    hint, relift = cfg.algo.hint, cfg.algo.relift
    on = [k for k, v in (("algo.hint.mode", hint.mode != "off"),
                         ("algo.relift.every", relift.every > 0),
                         ("algo.mixed_policy", cfg.algo.mixed_policy)) if v]
    if on and cfg.algo.name != "grpo":
        raise ConfigError(f"{on[0]} is a GRPO option; algo.name={cfg.algo.name!r}")
    if on and cfg.env.name:
        raise ConfigError(f"{on[0]} re-samples single-turn prompts; it is not supported with "
                          f"multi-turn episodes (env.name={cfg.env.name!r})")
    if cfg.algo.mixed_policy and hint.mode != "off":
        raise ConfigError("algo.mixed_policy=True and algo.hint.mode both act on failed "
                          "groups: use one")
    if hint.mode == "adaptive" and hint.min_fraction > hint.max_fraction:
        raise ConfigError(f"algo.hint.min_fraction={hint.min_fraction} must be <= "
                          f"algo.hint.max_fraction={hint.max_fraction}")
    if hint.mode != "off" and hint.fraction == 0.0 and hint.mode == "fixed":
        raise ConfigError("algo.hint.fraction=0.0 gives no hint; set it in (0, 1] or "
                          "algo.hint.mode='off'")


def _check_selection(cfg) -> None:
    """``data.selection``: a band with low <= high, an RL rollout to select for, and for
    ``curriculum`` a built-in task with the named difficulty knob."""
    sel, algo = cfg.data.selection, cfg.algo
    if sel.name == "uniform":
        return
    if sel.low > sel.high:
        raise ConfigError(f"data.selection.low={sel.low} must be <= data.selection.high="
                          f"{sel.high}")
    if algo.name not in ("grpo", "ppo"):
        raise ConfigError(f"data.selection.name='{sel.name}' selects prompts for RL "
                          f"rollouts: algo.name='{algo.name}' needs 'uniform'")
    if sel.name == "online_filter" and algo.dynamic_sampling:
        raise ConfigError("data.selection.name='online_filter' and algo.dynamic_sampling both "
                          "filter groups: use one (dynamic sampling = the band (0, 1))")
    if sel.name == "curriculum":
        from rljax.data.selection import DIFFICULTY_KNOBS  # noqa: PLC0415 (light module)
        knobs = DIFFICULTY_KNOBS.get(cfg.data.source)
        if knobs is None:
            tasks = "; ".join(f"{t}: {', '.join(k)}" for t, k in DIFFICULTY_KNOBS.items())
            raise ConfigError(f"data.selection.name='curriculum' needs a difficulty knob, and "
                              f"data.source='{cfg.data.source}' has none (built-in tasks: "
                              f"{tasks})")
        if sel.knob not in knobs:
            raise ConfigError(f"data.selection.knob='{sel.knob}' is not a difficulty knob of "
                              f"data.source='{cfg.data.source}' (one of: {', '.join(knobs)})")
        top = dict(cfg.data.kwargs).get(sel.knob)
        if sel.min_level < knobs[sel.knob] or (isinstance(top, int) and sel.min_level > top):
            upper = f" and <= data.kwargs.{sel.knob}={top}" if isinstance(top, int) else ""
            raise ConfigError(f"data.selection.min_level={sel.min_level} must be >= "
                              f"{knobs[sel.knob]}{upper}")


def _check_tree(cfg) -> None:
    """rollout.tree: a tree whose leaves are the group and whose segments fit max_new_tokens."""
    tree, algo = cfg.rollout.tree, cfg.algo
    if algo.adv_estimator in TREE_ESTIMATORS and not tree.enabled:
        raise ConfigError(f"algo.adv_estimator='{algo.adv_estimator}' uses the sampled tree: "
                          "set rollout.tree.enabled=true")
    if not tree.enabled:
        return
    others = [k for k, on in (
        ("rollout.temperature_schedule.name", cfg.rollout.temperature_schedule.name != "constant"),
        ("env.name", bool(cfg.env.name)), ("algo.hint.mode", algo.hint.mode != "off"),
        ("algo.mixed_policy", algo.mixed_policy)) if on]
    if others:   # each samples its own way; the tree sampler has none of them
        raise ConfigError(f"rollout.tree.enabled=true cannot be combined with {others[0]}")
    if algo.name != "grpo":
        raise ConfigError(f"rollout.tree.enabled=true needs algo.name='grpo' "
                          f"(got '{algo.name}')")
    g = algo.num_generations
    if tree.max_leaves and tree.max_leaves != g:
        raise ConfigError(f"rollout.tree.max_leaves={tree.max_leaves} must equal "
                          f"algo.num_generations={g} (a prompt's group is its tree's leaves)")
    from rljax.sampling.tree import tree_depth   # late: config itself needs no jax
    leaves, k, r = tree.max_leaves or g, tree.branching, tree.roots
    depth = tree_depth(r, k, leaves)
    if depth is None:
        raise ConfigError(f"rollout.tree.max_leaves={leaves} is not reachable: it must be "
                          f"rollout.tree.roots={r} * rollout.tree.branching={k} ** depth")
    if depth * tree.segment_tokens >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"rollout.tree.segment_tokens={tree.segment_tokens}: {depth} forks "
                          f"* {tree.segment_tokens} tokens must be < rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (the leaves need a segment)")
    if algo.adv_estimator == "rover" and algo.kl_in_reward:
        raise ConfigError("algo.kl_in_reward=true is not supported with "
                          "algo.adv_estimator='rover' (tree values carry no per-token KL)")
    if algo.adv_estimator == "rover" and algo.gamma != 1.0:
        raise ConfigError(f"algo.gamma={algo.gamma} must be 1.0 with algo.adv_estimator='rover'")


def _check_mesh(mesh) -> None:
    sizes = dict(mesh.items())
    if sum(1 for v in sizes.values() if v == -1) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ConfigError(f"mesh.{name}={size} must be >= 1 (or -1 for the rest)")
