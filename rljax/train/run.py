"""The single controller and the inference verbs: ``rljax train | eval | sample | export``.

    train(cfg, workdir)

reads top to bottom: check inputs (before anything compiles), build mesh / tokenizer / model,
restore the latest checkpoint if there is one, then run the phases: the SFT warm-up
(``sft.steps``), then ``steps`` iterations of ``algo.name``. Every iteration is
``rollout -> reward -> advantage -> update`` inside the phase, then the hooks
(``rljax.train.hooks``): ``log -> checkpoint -> eval``. SIGTERM / SIGINT finish the current
iteration (or stop an eval between chunks), save, and return (0 / 130). A step's checkpoint is
written before its eval.

Algorithms plug in as phases (``rljax.train.phases.ALGORITHMS``: ``name -> factory(ctx, steps)
-> Phase``). Global step numbers (metrics, checkpoints) count iterations over all phases: the
warm-up's ``1..sft.steps``, then the RL iterations.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import jax

from rljax import compilation_cache
from rljax import config as config_lib
from rljax import distributed, models, sampling, tokenizers
from rljax import plan as plan_lib
from rljax.errors import UserError, WorkdirInUse
from rljax.models import hf_vision
from rljax.train.core import evaluate as eval_lib
from rljax.train.core import paths
from rljax.train.core import workdir as workdir_lib
from rljax.train.core.checkpoint import CheckpointManager, checkpoint_dir
from rljax.train.core.faults import StopSignal
from rljax.train.inference import (initial_state, load_for_inference, phase_offsets,
                                   prm_best_of_n, restore_for_training, start_phase)
from rljax.train.core.metrics import MetricsWriter, read_metrics
from rljax.train.core.summary import run_summary
from rljax.train.core.optim import NonFiniteGuard
from rljax.train.phases import make_phases
from rljax.train.core.rollout_metrics import print_completions
from rljax.train.core.setup import build_context, check_inputs, stop_ids
from rljax.train.hooks import (Run, announced_if_slow, default_hooks, eval_schedule,
                               run_phases, setup_objects_frozen)
from rljax.train.methods import agent

# ----------------------------------------------------------------------------- train

def train(cfg, workdir: str, *, devices=None, stop: StopSignal | None = None,
          allow_config_change: bool = False, checkpoint: int | None = None) -> int:
    """``rljax train``: runs (or resumes) the run in ``workdir``; returns the exit code.

    A checkpointed ``workdir`` whose ``config.json`` differs from ``cfg`` is refused before
    anything is written (``workdir_lib.check_reuse``; ``allow_config_change`` for
    hyper-parameters); ``config.json`` is rewritten only once the checkpoint has restored.
    ``checkpoint``: resume from that step instead of the newest; later checkpoints are moved
    aside to ``<step>.discarded`` (they belong to the abandoned continuation)."""
    distributed.initialize()  # multi-host (SPMD): the same loop on every host
    config_lib.validate(cfg)
    # A refused new run leaves its workdir as it found it (process 0 owns the files).
    with (workdir_lib.removed_if_refused(workdir) if jax.process_index() == 0
          else contextlib.nullcontext()):
        return _checked_train(cfg, workdir, devices, stop, allow_config_change, checkpoint)


def _checked_train(cfg, workdir: str, devices, stop, allow_config_change: bool,
                   checkpoint: int | None) -> int:
    workdir_lib.check_reuse(workdir, cfg, allow_config_change)
    compilation_cache.from_config(cfg)
    check_inputs(cfg, len(devices) if devices is not None else None)
    plan_lib.check(cfg, devices)  # stop before allocating anything if it cannot fit
    # One run per workdir: process 0 holds the lock; every host stops if it is taken.
    release, busy = (lambda: None), None
    if jax.process_index() == 0:
        try:
            release = workdir_lib.lock(workdir)
        except WorkdirInUse as e:
            busy = e
    if distributed.any_process(busy is not None):
        raise busy or WorkdirInUse(f"{workdir} is in use by another `rljax train`")
    try:
        return _train(cfg, workdir, devices, stop or StopSignal(), checkpoint)
    finally:
        release()


def _train(cfg, workdir: str, devices, stop: StopSignal, checkpoint: int | None) -> int:
    paths.makedirs(workdir)  # a local directory or a URL (gs://...)
    # A checkpoint or GGUF file may load for a minute; a preset is built in a moment (and
    # refusals during its setup stay one line).
    with (announced_if_slow(f"loading the model ({cfg.model.path}) and tokenizer")
          if cfg.model.path else contextlib.nullcontext()):
        ctx = build_context(cfg, workdir, devices)
    phases = make_phases(ctx)
    # Held-out prompts, read before the checkpoint manager starts (a bad eval file is one line).
    examples = (eval_lib.eval_examples(ctx)
                if any(not hasattr(p, "evaluate") for p in phases) else None)
    if cfg.env.name:   # an episode's prompt that outgrows its bucket: one line, not a crash
        agent.check_episode_prompts(ctx, examples or eval_lib.eval_examples(ctx))
    offsets = phase_offsets(phases)
    total = offsets[-1] + phases[-1].steps
    ctx.stop = stop  # a reward call still running when a stop is requested is abandoned
    ckpt = CheckpointManager(checkpoint_dir(workdir), max_to_keep=cfg.checkpoint.max_to_keep,
                             async_save=cfg.checkpoint.async_save)
    guard = NonFiniteGuard(cfg.optimizer.max_consecutive_nonfinite)
    try:
        position = _restore(cfg, workdir, ctx, phases, ckpt, guard, checkpoint, total)
        if position is None:
            ckpt.close()
            return 0
        writer = _metrics_writer(cfg, workdir, phases, offsets, position)
    except BaseException:
        ckpt.close()
        raise

    def evaluate_fn(params, rng, stop):
        return eval_lib.run_eval(ctx, params, rng, examples, stop=stop,
                                 progress_every_s=cfg.logging.console_every_s,
                                 episodes=agent.run_agent_eval)

    run = Run(cfg=cfg, ctx=ctx, phases=phases, offsets=offsets, ckpt=ckpt, writer=writer,
              guard=guard, stop=stop, evaluate_fn=evaluate_fn,
              eval_size=len(examples) if examples else 0, state=position["state"],
              index=position["index"], start=position["start"], gstep=position["gstep"])
    cache_note = (" (slow on the first run of a config only: the compilation cache keeps it)"
                  if compilation_cache.resolve_dir(cfg.compilation_cache_dir) else "")
    # handlers stay installed until the checkpoint is closed (2nd signal: 130)
    with stop, setup_objects_frozen():
        try:
            code = run_phases(run, default_hooks(cfg),
                              start_phase=lambda phase, state: start_phase(ctx, phase, state),
                              initial_state=lambda: initial_state(ctx),
                              eval_pending=position["eval_pending"], cache_note=cache_note)
            if code is not None:
                return code
            ckpt.wait_until_finished()
            summary = run_summary(workdir, writer.evals, ckpt.all_steps(), ckpt.directory,
                                  cfg.checkpoint.max_to_keep, cfg.logging.tensorboard,
                                  labels=eval_labels(phases, offsets))
        finally:
            try:
                writer.close()
            finally:  # a failed metrics write must not leave a checkpoint save unfinished
                ckpt.close()
    if writer.enabled:
        print(summary, flush=True)  # where the results are, and what to do with them
    return 0


def _metrics_writer(cfg, workdir: str, phases, offsets, position: dict) -> MetricsWriter:
    """The run's metrics writer. Rows after the checkpoint (or all rows, starting from
    scratch) belong to an interrupted run that is redone now; an eval the checkpoint still
    owes is redone too."""
    return MetricsWriter(workdir, total_steps=offsets[-1] + phases[-1].steps,
                         phases=[(p.name, offsets[i], offsets[i] + p.steps)
                                 for i, p in enumerate(phases)],
                         console_every_s=cfg.logging.console_every_s,
                         tensorboard=cfg.logging.tensorboard, resume_step=position["gstep"],
                         wandb=cfg.logging.wandb.to_dict(),
                         drop_eval_at_resume=position["eval_pending"], config=cfg.to_dict(),
                         eval_steps=eval_schedule(cfg, phases, offsets))


def _restore(cfg, workdir: str, ctx, phases, ckpt, guard, checkpoint: int | None,
             total: int) -> dict | None:
    """Where the run starts: ``{state, index, start, gstep, eval_pending}`` from the newest
    checkpoint (or ``checkpoint``), or from scratch; None when the run is already complete.
    Writes ``config.json`` once the checkpoint has restored."""
    ckpt.check_writable()  # a read-only folder fails now, not after the first steps
    if checkpoint is not None:
        _discard_after(ckpt, int(checkpoint))
    position = dict(state=None, index=0, start=0, gstep=0, eval_pending=False)
    restored = restore_for_training(ctx, phases, ckpt, checkpoint,
                                    fallback=cfg.checkpoint.fallback_on_damage)
    if restored is not None:
        state, meta, gstep = restored
        index, start = int(meta["phase"]), int(meta["phase_step"])
        phases[index].load_state_dict(meta["phase_state"])
        guard.load_state_dict(meta["guard"])
        eval_pending = bool(meta.get("eval_pending", False))
        position = dict(state=state, index=index, start=start, gstep=gstep,
                        eval_pending=eval_pending)
        print(f"rljax: resumed at step {gstep} ({phases[index].name} {start}/"
              f"{phases[index].steps})", file=sys.stderr, flush=True)
        if gstep >= total and finished(workdir, gstep, eval_pending):
            print(f"rljax: the run in {workdir} is already complete (step {gstep} of "
                  f"{total}, final eval logged): nothing to do; raise `steps` to train "
                  "further", file=sys.stderr, flush=True)
            return None
        if gstep >= total:
            print(f"rljax: nothing to train: the checkpoint is at step {gstep} of {total}; "
                  f"only its final eval is owed", file=sys.stderr, flush=True)
    workdir_lib.write_config(workdir, cfg)  # after a successful restore: never a config
    #                                         the workdir's checkpoint does not fit
    # A run killed after committing a step but before deleting an old one keeps one too
    # many (safe to prune: the workdir lock says no other run is writing here).
    ckpt.prune()
    return position


def _discard_after(ckpt, checkpoint: int) -> None:
    """``--checkpoint N``: checkpoints after N belong to the abandoned continuation."""
    if checkpoint not in ckpt.all_steps():
        raise UserError(f"--checkpoint {checkpoint}: no such checkpoint in "
                        f"{ckpt.directory}; saved steps: {ckpt.all_steps()}")
    later = [s for s in ckpt.all_steps() if s > checkpoint]
    for s in later:
        ckpt.move_aside(s, "discarded")
    if later:
        print(f"rljax: resuming from checkpoint {checkpoint}: moved the later "
              f"checkpoints {later} aside to <step>.discarded", file=sys.stderr, flush=True)


def eval_labels(phases, offsets) -> dict[int, str]:
    """Global step -> what it is, for the summary: 0 "before training", each phase's last step
    ("end of the SFT warm-up", "end of grpo")."""
    labels = {0: "before training"}
    for phase, offset in zip(phases, offsets):
        labels[offset + phase.steps] = ("end of the SFT warm-up" if phase.name == "sft_warmup"
                                        else f"end of {phase.name}")
    return labels


def finished(workdir: str, step: int, eval_pending: bool) -> bool:
    """Whether a run whose last checkpoint is ``step`` (the last step) has nothing left to
    do: no eval owed, or the owed eval's ``eval/*`` line is already in ``metrics.jsonl`` (the
    final checkpoint is written before the final eval, so it always says one is owed)."""
    if not eval_pending:
        return True
    try:
        records = read_metrics(workdir)
    except (OSError, ValueError):
        return False
    return any(r.get("step") == step and any(str(k).startswith("eval/") for k in r)
               for r in records)


# ----------------------------------------------------------------------------- inference

def evaluate(cfg, workdir: str, checkpoint: str | None = None, devices=None) -> int:
    """``rljax eval --workdir DIR``: evaluates a checkpoint (default: latest), prints JSON."""
    ctx, state, step = load_for_inference(cfg, workdir, checkpoint, devices=devices)
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, eval_lib.EVAL_STREAM), step)
    if _is_reward_model(cfg, state):  # held-out pair accuracy of the reward model
        metrics = make_phases(ctx)[-1].evaluate(state, rng)
    else:
        metrics = eval_lib.run_eval(ctx, state.params, rng, episodes=agent.run_agent_eval)
    print(json.dumps({"step": step, **metrics}), file=sys.stdout, flush=True)
    return 0


def evaluate_best_of_n(cfg, workdir: str, prm_workdir: str, n: int = 8, mode: str | None = None,
                       checkpoint: str | None = None, devices=None, beams: int = 0) -> int:
    """``rljax eval --workdir DIR --prm PRM_DIR``: best-of-``n`` (or with ``beams``, a
    step-level beam search) guided by a process reward model
    (``rljax.train.inference.prm_best_of_n``); prints JSON."""
    metrics = prm_best_of_n(cfg, workdir, prm_workdir, n, mode, checkpoint, devices, beams)
    print(json.dumps(metrics), file=sys.stdout, flush=True)
    return 0


def sample(cfg, workdir: str | None, prompts: list[str], checkpoint: str | None = None,
           devices=None, raw: bool = False) -> int:
    """``rljax sample``: completions of ``prompts`` (eval temperature; greedy by default).

    Each prompt goes through the run's prompt template and, with ``tokenizer.chat_template``,
    the chat template, exactly as training and eval render a data set's question; ``raw``
    feeds the text to the model as it is. Prints each rendered prompt and its completion
    between marker lines."""
    ctx = None
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
        model_cfg, params = models.load_hf(checkpoint)
        tok = tokenizers.load(checkpoint)
    else:
        if not workdir:
            raise UserError("sample needs --workdir (or --checkpoint HF_DIR)")
        ctx, state, _ = load_for_inference(cfg, workdir, checkpoint, devices)
        model_cfg, params, tok = ctx.model_cfg, state.params, ctx.tokenizer
    texts = list(prompts) if raw else render_prompts(cfg, tok, prompts, ctx)
    if cfg.env.name and ctx is not None:   # multi-turn: the whole episode, tools included
        return _sample_episodes(ctx, params, prompts, texts)
    ids = [tok.encode(p) for p in texts]
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    check_prompt_lengths([len(i) for i in ids], max_new, model_cfg.max_position_embeddings)
    p_tok, p_mask = sampling.pad_to_bucket(ids, pad_id=tok.pad_id)
    out = sampling.generate(model_cfg, params, p_tok, p_mask, rng=jax.random.PRNGKey(cfg.seed),
                            max_new_tokens=max_new,
                            temperature=cfg.eval.temperature,
                            eos_id=stop_ids(cfg, tok),
                            pad_id=tok.pad_id)
    completions = tok.batch_decode(jax.device_get(out.tokens), jax.device_get(out.mask))
    print_completions(texts, completions, file=sys.stdout)
    return 0


def check_prompt_lengths(lengths: list[int], max_new_tokens: int, context: int) -> None:
    """UserError (one line) when a prompt of ``lengths[i]`` tokens plus ``max_new_tokens``
    does not fit the model's ``context`` positions (its completion came back empty)."""
    for i, n in enumerate(lengths):
        if n + max_new_tokens > context:
            raise UserError(f"prompt {i + 1} is {n} tokens; with {max_new_tokens} new tokens "
                            f"it needs {n + max_new_tokens} positions, more than the model's "
                            f"context (max_position_embeddings={context}); shorten it (or "
                            "lower eval.max_new_tokens)")


def _sample_episodes(ctx, params, questions: list[str], texts: list[str]) -> int:
    """One episode per prompt in the run's environment (eval temperature); prints each
    episode's rendered first messages and its whole transcript (model turns and
    observations)."""
    cfg = ctx.cfg
    examples = [{"prompt": t, "question": q} for q, t in zip(questions, texts)]
    eps = agent.play(ctx, params, examples, jax.random.PRNGKey(cfg.seed), num_samples=1,
                     temperature=cfg.eval.temperature)
    for i in range(len(examples)):
        print(f"--- prompt ---\n{eps['prompts'][i]}\n--- episode ({eps['turns'][i]} turns, "
              f"environment reward {eps['env_rewards'][i]:.3g}"
              f"{', truncated' if eps['truncated'][i] else ''}) ---\n{eps['transcripts'][i]}",
              file=sys.stdout, flush=True)
    return 0


def holds_template(template: str, text: str) -> bool:
    """Whether ``text`` is already ``template`` filled in: it starts with the text before the
    template's one field and ends with the text after it (not both empty, as ``{question}``)."""
    import string
    parts = list(string.Formatter().parse(template))
    at = [i for i, (_, name, _, _) in enumerate(parts) if name is not None]
    if len(at) != 1:
        return False
    prefix = "".join(lit for lit, _, _, _ in parts[:at[0] + 1])
    suffix = "".join(lit for lit, _, _, _ in parts[at[0] + 1:]).rstrip()
    body = text.rstrip()
    return (bool(prefix.strip() or suffix) and len(body) >= len(prefix) + len(suffix)
            and body.startswith(prefix) and body.endswith(suffix))


def render_prompts(cfg, tok, prompts: list[str], ctx=None) -> list[str]:
    """``prompts`` as the run's data pipeline renders a question: ``data.template`` (its one
    field filled with the text), then the chat template when ``tokenizer.chat_template``. A
    prompt that already holds the data template's text (``What is 23+45=`` for ``What is
    {question}``) is taken as the filled-in template, with one line saying so."""
    from rljax import data as data_lib
    from rljax.train.core.inputs import _template

    spec = ctx.data_config() if ctx is not None else {
        "template": _template(cfg), "chat": bool(cfg.tokenizer.chat_template),
        **{k: v for k, v in dict(cfg.data.kwargs).items() if k == "system_prompt"}}
    try:
        template = data_lib.make_template(spec, tok)
    except ValueError as e:
        raise UserError(f"cannot render the prompt: {e} (pass --raw to send it as it is)")
    if len(template.fields) != 1:
        raise UserError(f"data.template {template.template!r} has fields {template.fields}, "
                        f"not one for the prompt text; pass --raw to send the prompt as it is")
    field = template.fields[0]
    as_is = data_lib.make_template({**spec, "template": "{" + field + "}"}, tok)
    out = []
    for i, p in enumerate(prompts):
        if holds_template(template.template, p):
            print(f"rljax: prompt {i + 1} already holds data.template {template.template!r}: "
                  "used as it is (the chat template still applies; --raw sends it untouched)",
                  file=sys.stderr, flush=True)
            out.append(as_is({field: p}))
        else:
            out.append(template({field: p}))
    return out


def export(cfg, workdir: str, out: str, checkpoint: str | None = None, devices=None,
           overwrite: bool = False, adapter: bool = False) -> int:
    """``rljax export``: the checkpoint's policy as a Hugging Face model directory ``out``:
    safetensors + config.json, and the tokenizer's files (for an HF tokenizer:
    ``tokenizer.json``, ``tokenizer_config.json`` with the chat template, special tokens).

    ``out`` must be empty or new (``overwrite`` replaces files in a non-empty one), and may
    never be a run directory: not ``workdir``, nothing inside it, nor another run's.

    LoRA runs: the adapters merged into the base; with ``adapter``, the adapters alone as a
    PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) whose
    ``base_model_name_or_path`` is ``model.path``; a GGUF base (a file PEFT cannot load) is
    written dequantized as an HF directory ``out/base`` (weights, config, tokenizer) and named
    instead (absolute path), so ``peft.AutoPeftModelForCausalLM.from_pretrained(out)`` works."""
    if adapter and not (cfg.model.lora.rank or cfg.model.adapter_path):
        raise UserError(f"export --adapter: the run in {workdir} does not use LoRA "
                        "(model.lora.rank is 0)")
    workdir_lib.check_export_target(workdir, out, overwrite)
    ctx, state, step = load_for_inference(cfg, workdir, checkpoint, devices)
    if adapter:
        base = cfg.model.path
        if base and models.is_gguf_path(base):  # PEFT loads a base directory, not a .gguf
            base = os.path.abspath(os.path.join(out, GGUF_BASE_DIR))
            models.save_hf(ctx.model_cfg, models.lora.base_params(state.params), base)
            save_tokenizer = getattr(ctx.tokenizer, "save", None)
            if save_tokenizer is not None:
                save_tokenizer(base)
        models.peft.save_adapter(ctx.model_cfg, state.params["lora"], out,
                                 base_model_name_or_path=base)
        also = (f" with its GGUF base dequantized to an HF directory {base} "
                "(base_model_name_or_path)" if base != cfg.model.path else "")
        print(f"rljax: exported the LoRA adapter of step {step} to {out}{also}",
              file=sys.stderr, flush=True)
        return 0
    what = "policy"
    if _is_reward_model(cfg, state):
        # LoRA: the reward model's adapters on the policy's base, merged.
        value = models.lora.value_on_base(state.params, state.critic_params)
        value = {**value, "trunk": models.lora.merge(ctx.model_cfg, value["trunk"])}
        process = cfg.algo.name == "prm"
        bias = models.save_hf_value(ctx.model_cfg, value, out, token_classification=process)
        what = ("process reward model (AutoModelForTokenClassification, num_labels=2)"
                if process else "reward model (AutoModelForSequenceClassification, num_labels=1)")
        if bias:
            print(f"rljax: note: the value head's bias {bias:.4g} is not in HF's score layer "
                  "(config.json: rljax_value_head_bias); add it to get rljax's scores",
                  file=sys.stderr, flush=True)
    elif ctx.model_cfg.vision is not None:   # the whole VLM: text model, tower, projector
        what = "policy (Gemma3ForConditionalGeneration, with its vision tower)"
        hf_vision.save_hf_vlm(ctx.model_cfg, models.lora.merge(ctx.model_cfg, state.params),
                              out, extra_config=hf_vision.image_marker_ids(
                                  cfg.model.path if cfg.model.vision.load else None))
    else:
        models.save_hf(ctx.model_cfg, models.lora.merge(ctx.model_cfg, state.params), out)
    save = getattr(ctx.tokenizer, "save", None)
    if save is not None:  # HF: tokenizer files + chat template; char: char_tokenizer.json
        save(out)
    print(f"rljax: exported the {what} of step {step} to {out}", file=sys.stderr, flush=True)
    return 0


GGUF_BASE_DIR = "base"  # export --adapter of a GGUF run: the base as HF weights, in OUT/base


def _is_reward_model(cfg, state) -> bool:
    """A (process) reward-model run past its warm-up: eval/export act on the reward model."""
    return cfg.algo.name in ("rm", "prm") and state.critic_params is not None
