"""The training algorithm: the ``algo`` section (GRPO family, PPO, DPO, guidance) and the
``sft`` warm-up, their algorithm-dependent defaults (:func:`resolve`), their checks, and the
live registries their names come from (phases, advantage estimators, policy losses, KL
estimators, aggregation modes, DPO losses)."""
from __future__ import annotations

from typing import Any, Mapping

from rljax.config.base import ConfigError, opt_float, registered

# Per-loss defaults of the clip keys left unset (None), as in each loss's signature
# (rljax.algorithms.policy_losses; tests/test_config.py checks they agree). A None here is the
# loss's own meaning of None: ppo's epsilon_high = epsilon (symmetric clip), cispo's
# epsilon = no lower bound (the paper's one-sided clip). A registered loss not listed here
# keeps None, so its own signature's defaults apply.
POLICY_LOSS_DEFAULTS: dict[str, dict[str, float | None]] = {
    "ppo": {"epsilon": 0.2, "epsilon_high": None},
    "vanilla": {"epsilon": 0.2, "epsilon_high": None},
    "gspo": {"epsilon": 3e-4, "epsilon_high": 4e-4},    # Zheng et al. 2025
    "cispo": {"epsilon": None, "epsilon_high": 0.28},   # MiniMax-M1
}

# ``algo.beta`` left unset: the phase's default. It is the KL-to-reference coefficient in GRPO
# and PPO (0.04, the GRPO paper's) and the inverse temperature of the implicit reward in DPO
# (0.1, the DPO paper's and TRL's usual value).
# Distillation's anchor is the teacher, so it needs no reference model unless asked for.
BETA_DEFAULTS: dict[str, float] = {"dpo": 0.1, "distill": 0.0}
BETA_DEFAULT = 0.04

# Advantage estimators that normalise within a prompt's group, so they need G >= 2.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline",
                    "reinforce_pp_baseline_seq", "treepo", "rover", "grpo_process")
# Outcome estimators that per-turn returns plug into (env.turn_discount; the same tuple as
# rljax.algorithms.turn_credit.TURN_ESTIMATORS, not imported: config loads without jax).
TURN_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# The built-in advantage estimators over the sampled tree (a registered one says so itself:
# rljax.algorithms.uses_tree); they need rollout.tree.enabled.
TREE_ESTIMATORS = ("treepo", "rover")


def algo() -> dict[str, Any]:
    return dict(
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
                                     # (partial/async: None = the weight uncapped)
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        adv_estimator="grpo",        # grpo, dr_grpo, rloo (one advantage per completion);
                                     # reinforce_pp, reinforce_pp_baseline (per token, whitened
                                     # over the batch's tokens, as the paper); *_seq variants:
                                     # one per completion, whitened over completions;
                                     # rae: return minus a baseline per (game, seat) kept
                                     # across steps (games with env.name; SPIRAL's RAE)
        rae_alpha=0.95,              # rae: b <- alpha * b + (1 - alpha) * mean return
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
                                     # float32 order; rljax.train.core.length_groups)
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
        # Mixture-of-experts policies: weight of the load-balancing loss added to the update's
        # loss (metric moe/load_balance: its value, num_experts_per_tok when balanced).
        moe_aux_loss_coef=0.0,
        # Routing replay (GRPO, distill, PPO; mixtures of experts): the sampler records each token's experts
        # and the update's forward sends the token to those (the router still weights them and
        # gets its gradient), so sampler and trainer agree on the routes.
        routing_replay=False,
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
        # algo.name='prm' (process reward model; docs/tree_search.md): labels from a stepwise file,
        # or on a built-in task sampled as Math-Shepherd's (num_generations continuations of
        # each step prefix, step_mc.max_steps - 1 prefixes per solution). soft_labels: train
        # on the fraction of continuations with reward >= correct_reward (else on fraction >
        # 0); step_score: how a solution's step scores combine (min, last, mean, prod).
        prm=dict(soft_labels=False, correct_reward=1.0, step_score="min"),
        # MCTS over steps (sft.traces='mcts', data.pairs='mcts'; docs/tree_search.md): per
        # prompt, `simulations` select/expand/evaluate/backup rounds; an expansion samples
        # `children` next steps (priors: their probabilities); a leaf is valued by `rollouts`
        # continuations to the end (value 'mc') or by the PRM run in workdir `prm` (value
        # 'prm'); a terminal node by its reward (>= correct_reward: verified). No expansion
        # once a tree holds `max_nodes`.
        # refit_prm (value 'prm'): after each round's search the PRM takes `refit_updates`
        # updates on the search's per-step values (each visited node's Q at its step end), at
        # `refit_learning_rate` (0 = optimizer.critic_learning_rate, else learning_rate).
        mcts=dict(simulations=8, children=4, rollouts=4, max_nodes=64, c_puct=1.0,
                  unvisited_value=0.0, value="mc", prm="", correct_reward=1.0,
                  refit_prm=False, refit_updates=1, refit_learning_rate=0.0),
        # adv_estimator="grpo_process" (docs/tree_search.md): the PRM of the algo.name="prm" run in
        # workdir `prm` scores every step of every sample; the tokens' process advantages
        # (step scores normalised over the group, summed from the token's step on) are added,
        # times `weight`, to GRPO's outcome advantage.
        process_reward=dict(prm="", weight=1.0),
        # adv_estimator="vineppo" (GRPO phase; docs/search.md): each completion is cut into
        # steps (splitter "newline", or "regex": a step ends where `regex` matches the text's
        # end); `forks` continuations are sampled from every step prefix (the first
        # max_steps - 1 boundaries; later steps join the last), V(prefix) = their mean
        # reward, and the tokens of step t get V(s_t+1) - V(s_t) (the last: R - V(s_last)).
        vine=dict(forks=4, max_steps=4, splitter="newline", regex=""),
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
        # On-policy distillation (algo.name='distill'; docs/algorithms.md): the student samples,
        # a frozen teacher scores every sampled token, and the GRPO update trains on the
        # per-token reverse KL to the teacher as the advantage (discount 0).
        distill=dict(
            teacher="",              # an HF checkpoint dir, a GGUF file or an rljax workdir
                                     # (relative: to the working directory)
            teacher_step=0,          # workdir teacher: this checkpoint step; 0 = the latest
            teacher_quantize="",     # keep the teacher quantized on device: int8, int4, nf4
                                     # (one scale per model.quantize_block inputs) or keep
                                     # (a GGUF teacher's own blocks); "" = model.dtype
            teacher_temperature=1.0,  # the teacher's log-probs are log_softmax(logits / this)
                                     # (1 = the teacher's own distribution, the published
                                     # form; the student is scored at the rollout's)
            kl_weight=1.0,           # weight of -(log pi_student - log pi_teacher) per token
            reward_weight=0.0,       # weight of the task advantage (algo.adv_estimator)
            jsd_weight=0.0,          # weight of GKD's generalised JSD over the teacher's top-k
                                     # (a full-distribution loss term); 0 = off
            jsd_beta=0.5,            # its beta: 0 = forward KL(teacher||student), 1 = reverse
            top_k=16,                # teacher tokens per position the JSD term reads
        ),
        # Asynchronous RL (GRPO; docs/internals.md): update k trains on the samples drawn by
        # the policy of version k - async_lag (the first updates on the starting policy's),
        # sampled while update k - async_lag runs; behaviour log-probs feed the decoupled
        # loss (as rollout.partial). A fixed schedule: reproducible, resumes exactly. With
        # mesh.rollout_devices the sampler has devices of its own.
        asynchronous=False,
        async_lag=1,
        # In-flight weight updates (asynchronous RL with rollout.engine='slots'): a finished
        # update reaches the sampler between decode chunks, so a completion may span two
        # versions (each token records its own). Fresher samples; not reproducible (when
        # the update finishes decides which tokens the new weights draw).
        inflight_updates=False,
        mixed_policy=False,          # LUFFY-style: the reference solution replaces one sample
                                     # of a group that failed entirely (importance ratio
                                     # pi_theta / 1, so <= 1); an alternative to hints
    )


def sft() -> dict[str, Any]:
    return dict(
        steps=0,                     # warm-up SFT steps before RL; 0 = none
        learning_rate=1e-5,
        batch_size=16,
        max_length=512,
        source="",                   # "" = data.source
        path="",
        traces="",                   # algo.name='sft': "" = the data's solutions; "mcts" =
                                     # each step searches sft.batch_size prompts and trains on
                                     # the best verified trace per prompt (algo.mcts; the
                                     # warm-up keeps the data's solutions)
        env_traces=False,            # with env.name: train on the environment's scripted
                                     # episodes (tool calls, observations as context)
        trace_noise=0.0,             # guess_number traces: chance that a guess is random in
                                     # the interval left instead of the midpoint; games: that
                                     # a move is a random legal one, not the scripted player's
    )


SECTIONS = {"algo": algo, "sft": sft}

CHOICES = {
    "algo.distill.teacher_quantize": ("", "int8", "int4", "nf4", "keep"),
    "algo.scale_rewards": ("group", "batch", "none"),
    "algo.importance_sampling_level": ("token", "sequence"),
    "algo.hint.mode": ("off", "fixed", "adaptive"),
    "algo.hint.source": ("reference", "replay"),
    "algo.relift.prompts": ("failed", "any"),
    "algo.vine.splitter": ("newline", "regex"),
    "algo.prm.step_score": ("min", "last", "mean", "prod"),
    "algo.mcts.value": ("mc", "prm"),
    "sft.traces": ("", "mcts"),
}


# Live registries, looked up when a config is validated (jax is imported then, not when the
# config module loads), so names registered by user code (``imports``) are accepted.
def _algorithms():
    from rljax.train.phases import ALGORITHMS

    return registered(ALGORITHMS)


def _advantage_estimators():
    from rljax import algorithms

    return registered((*algorithms.advantage_estimator_names(), "gae"))  # gae: PPO's critic


def _policy_losses():
    from rljax import algorithms

    return registered(algorithms.policy_loss_names())


def _kl_estimators():
    from rljax import algorithms

    return registered(algorithms.kl_estimator_names())


def _aggregation_modes():
    from rljax import algorithms

    return registered(algorithms.AGGREGATION_MODES)


def _dpo_loss_types():
    from rljax import algorithms

    return registered(algorithms.DPO_LOSS_TYPES)


REGISTRIES = {
    "algo.name": _algorithms,
    "algo.adv_estimator": _advantage_estimators,
    "algo.kl_estimator": _kl_estimators,
    "algo.loss_agg_mode": _aggregation_modes,
    "algo.policy_loss": _policy_losses,
    "algo.loss_type": _dpo_loss_types,
}

RANGES = (
    ("algo.vine.forks", 1, None), ("algo.vine.max_steps", 1, None),
    ("algo.mcts.simulations", 1, None), ("algo.mcts.children", 1, None),
    ("algo.mcts.rollouts", 1, None), ("algo.mcts.max_nodes", 2, None),
    ("algo.mcts.c_puct", 0.0, None), ("algo.mcts.refit_updates", 1, None),
    ("algo.mcts.refit_learning_rate", 0.0, None), ("algo.process_reward.weight", 0.0, None),
    ("algo.update_streams", 0, None), ("algo.async_lag", 1, None),
    ("algo.num_generations", 1, None), ("algo.beta", 0.0, None),
    ("algo.num_iterations", 1, None),
    ("algo.mini_batch_size", 0, None), ("algo.micro_batch_size", 0, None),
    ("algo.entropy_coef", 0.0, None), ("algo.max_sampling_rounds", 0, None),
    ("algo.moe_aux_loss_coef", 0.0, None),
    ("algo.overlong_buffer", 0, None), ("algo.overlong_penalty_factor", 0.0, None),
    ("algo.gamma", 0.0, 1.0), ("algo.lam", 0.0, 1.0), ("algo.rae_alpha", 0.0, 1.0),
    ("algo.vf_coef", 0.0, None), ("algo.cliprange_value", 0.0, None),
    ("algo.label_smoothing", 0.0, 0.5), ("algo.ref_update_every", 0, None),
    ("algo.hint.fraction", 0.0, 1.0), ("algo.hint.target", 0.0, 1.0),
    ("algo.hint.min_fraction", 0.0, 1.0), ("algo.hint.max_fraction", 0.0, 1.0),
    ("algo.hint.step", 0.0, None), ("algo.hint.max_prompts", 1, None),
    ("algo.relift.every", 0, None), ("algo.relift.k_visits", 1, None),
    ("algo.relift.batch_size", 1, None), ("algo.relift.buffer_size", 1, None),
    ("algo.relift.coef", 0.0, None),
    ("algo.distill.teacher_step", 0, None), ("algo.distill.kl_weight", 0.0, None),
    ("algo.distill.teacher_temperature", 1e-3, None),
    ("algo.distill.reward_weight", 0.0, None), ("algo.distill.jsd_weight", 0.0, None),
    ("algo.distill.jsd_beta", 0.0, 1.0), ("algo.distill.top_k", 1, None),
    ("sft.steps", 0, None), ("sft.learning_rate", 1e-30, None), ("sft.batch_size", 1, None),
    ("sft.max_length", 1, None), ("sft.trace_noise", 0.0, 1.0),
)
# Optional numbers: None (off / the loss's default) or above the bound.
ABOVE = (("algo.clip_ratio_c", 1), ("algo.tis_cap", 0))


def resolve(cfg) -> dict[str, Any]:
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


def check_clip_signs(cfg) -> None:
    for key in ("epsilon", "epsilon_high"):
        value = cfg.algo[key]
        if value is not None and value < 0:
            raise ConfigError(f"algo.{key}={value!r} must be >= 0 (or None for the loss's "
                              "default)")


def check_batch_sizes(cfg) -> None:
    """Batch splits that divide evenly; all problems in one line."""
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


def check_groups_and_clip(cfg, filled: Mapping[str, Any] | None = None) -> None:
    """Group sizes the estimator or online DPO needs, and a clip range with low <= high."""
    algo = cfg.algo
    g = algo.num_generations
    # Distillation normalises rewards per group only when the task reward is mixed in.
    grouped = algo.name == "grpo" or (algo.name == "distill" and algo.distill.reward_weight > 0)
    if grouped and algo.adv_estimator in GROUP_ESTIMATORS and g < 2:
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


def check_estimator_and_update(cfg) -> None:
    """GAE belongs to PPO's critic, and length grouping to the GRPO update."""
    algo = cfg.algo
    if algo.adv_estimator == "gae" and algo.name != "ppo":
        raise ConfigError("algo.adv_estimator='gae' needs a critic: set algo.name='ppo'")
    if algo.name == "ppo" and algo.adv_estimator != "gae":
        raise ConfigError("algo.name='ppo' trains a critic for GAE: set algo.adv_estimator='gae'")
    if algo.group_by_length and algo.name not in ("grpo", "distill"):
        raise ConfigError(f"algo.group_by_length=True groups the GRPO update's micro-batches; "
                          f"algo.name='{algo.name}' does not use it (set it to False)")


def _uses_roles(estimator: str) -> bool:
    from rljax.algorithms import uses_roles  # the live registry's flag (user estimators too)

    return uses_roles(estimator)


def check_role_estimator(cfg) -> None:
    """An estimator with role baselines (RAE) needs episodes that name their role (a game
    environment), the GRPO phase that keeps the baselines, and one advantage per episode."""
    algo = cfg.algo
    if not _uses_roles(algo.adv_estimator):
        return
    what = f"algo.adv_estimator='{algo.adv_estimator}'"
    if algo.name != "grpo":
        raise ConfigError(f"{what} keeps its baselines in the GRPO phase; algo.name="
                          f"{algo.name!r}")
    if not cfg.env.name:
        raise ConfigError(f"{what} needs each episode's role: set env.name to a game "
                          "environment (tictactoe, kuhn_poker, negotiation, propose_solve)")
    if cfg.env.turn_discount is not None:
        raise ConfigError(f"{what} gives one advantage per episode: env.turn_discount "
                          "(per-turn returns) is not supported")


def check_guidance(cfg) -> None:
    """Hints, ReLIFT and demonstrations (``algo.hint``, ``algo.relift``, ``algo.mixed_policy``)
    are options of GRPO's rollout, which distillation and PPO share (the teacher scores and the
    critic values the guided rows as any row)."""
    hint, relift = cfg.algo.hint, cfg.algo.relift
    on = [k for k, v in (("algo.hint.mode", hint.mode != "off"),
                         ("algo.relift.every", relift.every > 0),
                         ("algo.mixed_policy", cfg.algo.mixed_policy)) if v]
    if on and cfg.algo.name not in ("grpo", "distill", "ppo"):
        raise ConfigError(f"{on[0]} is an option of GRPO, PPO and distillation; algo.name="
                          f"{cfg.algo.name!r}")
    if cfg.algo.mixed_policy and hint.mode != "off":
        raise ConfigError("algo.mixed_policy=True and algo.hint.mode both act on failed "
                          "groups: use one")
    if hint.mode == "adaptive" and hint.min_fraction > hint.max_fraction:
        raise ConfigError(f"algo.hint.min_fraction={hint.min_fraction} must be <= "
                          f"algo.hint.max_fraction={hint.max_fraction}")
    if hint.mode != "off" and hint.fraction == 0.0 and hint.mode == "fixed":
        raise ConfigError("algo.hint.fraction=0.0 gives no hint; set it in (0, 1] or "
                          "algo.hint.mode='off'")


def check_overlong(cfg) -> None:
    if cfg.algo.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer={cfg.algo.overlong_buffer} must be <= "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")


def check_distill(cfg) -> None:
    """A teacher exactly when distilling; single-turn rollouts; a signal that is not zero."""
    algo, d = cfg.algo, cfg.algo.distill
    if algo.name == "distill" and not d.teacher:
        raise ConfigError("algo.name='distill' needs algo.distill.teacher (an HF checkpoint "
                          "dir, a GGUF file or an rljax workdir)")
    if algo.name != "distill" and d.teacher:
        raise ConfigError(f"algo.distill.teacher is read by algo.name='distill' only "
                          f"(algo.name={algo.name!r})")
    if algo.name != "distill" and d.teacher_quantize:
        raise ConfigError(f"algo.distill.teacher_quantize is read by algo.name='distill' only "
                          f"(algo.name={algo.name!r})")
    if algo.name != "distill":
        return
    if d.teacher_quantize and (cfg.model.quantize_block <= 0 or cfg.model.quantize_block % 2):
        raise ConfigError(f"model.quantize_block={cfg.model.quantize_block} must be a positive "
                          "even number (the teacher's inputs sharing one scale)")
    if d.kl_weight == 0 and d.reward_weight == 0 and d.jsd_weight == 0:
        raise ConfigError("algo.distill.kl_weight, reward_weight and jsd_weight are all 0: "
                          "nothing would train")


def check_routing_replay(cfg) -> None:
    """Routing replay: GRPO, distillation or PPO, synchronous or asynchronous, on single-turn
    prompts sampled by the static sampler, the slot engine or the static tree sampler, or on
    episodes and self-play matches (the samplers that record routes)."""
    a, r = cfg.algo, cfg.rollout
    if not a.routing_replay:
        return
    problems = [what for what, bad in (
        (f"algo.name={a.name!r} (needs 'grpo', 'distill' or 'ppo')",
         a.name not in ("grpo", "distill", "ppo")),
        # (no meaning: a leaf's prefix is fed again at each level, under the weights of
        # that moment, so with in-flight updates its routes come from several versions)
        ("tree sampling on rollout.engine='slots' with algo.inflight_updates",
         bool(r.tree.enabled) and r.engine == "slots" and bool(a.get("inflight_updates"))),
        ("rollout.partial=true", bool(r.partial))) if bad]
    if problems:
        raise ConfigError("algo.routing_replay=true is not supported with " +
                          "; ".join(problems))


def check_async(cfg) -> None:
    """Asynchronous RL trains GRPO on batches sampled ahead: nothing that needs the update's
    policy while sampling, or samples in a loop of its own."""
    a, r = cfg.algo, cfg.rollout
    if a.inflight_updates and not a.asynchronous:
        raise ConfigError("algo.inflight_updates=true needs algo.asynchronous=true (weights "
                          "change mid-batch only while an update runs beside the sampler)")
    if not a.asynchronous:
        return
    if a.inflight_updates and r.engine != "slots":
        raise ConfigError("algo.inflight_updates=true needs rollout.engine='slots' (new weights "
                          f"enter between the engine's decode chunks; got rollout.engine="
                          f"{r.engine!r})")
    if a.name not in ("grpo", "distill", "ppo") and not (a.name == "dpo" and a.online):
        offline = ", algo.online=False" if a.name == "dpo" else ""
        raise ConfigError(f"algo.asynchronous=true needs algo.name='grpo', 'distill', 'ppo' "
                          f"or online 'dpo' (got '{a.name}'{offline})")
    if r.partial and r.max_staleness < a.async_lag:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} must be >= "
                          f"algo.async_lag={a.async_lag} with rollout.partial=true (a batch "
                          "trains async_lag versions after it was sampled)")
