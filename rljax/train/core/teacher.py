"""The frozen teacher of on-policy distillation (``algo.name='distill'``, ``algo.distill``):
where it comes from, whether it speaks the student's tokenizer, its weights on the student's
mesh, and the pass that scores the student's samples with it.

    source = resolve(cfg)                 # config and tokenizer files only: cheap
    check(cfg, student_tokenizer)         # one UserError line on a mismatch (check_inputs)
    model_cfg, params = load(source, mesh)
    score = build_score_fn(model_cfg, ...)   # jitted: (params, batch) -> teacher fields

A teacher is an HF checkpoint directory, a GGUF file, or an rljax workdir (its latest
checkpoint, or ``algo.distill.teacher_step``). Its parameters are sharded by its own logical
axes on the student's mesh (as the policy and the reference are), never trained and never
checkpointed: a resumed run reloads them from the same source, so resume stays exact.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from rljax import compilation_cache, models, tokenizers
from rljax import sharding as shd
from rljax.errors import ConfigError, UserError
from rljax.train.core import checkpoint as ckpt_lib, manifest
from rljax.train.core import quantized, steps
from rljax.train.core.paths import is_run_dir


@dataclasses.dataclass(frozen=True)
class Source:
    """A resolved teacher: ``kind`` hf | gguf | workdir; for a workdir, its validated config
    and the checkpoint directory of the chosen step."""
    kind: str
    path: str
    tokenizer: Any
    dtype: str
    cfg: Any = None          # workdir: the teacher run's model and tokenizer sections
    step_dir: str = ""       # workdir: checkpoints/<step>
    quantize: str = ""       # kept quantized on device: int8 | int4 | nf4 | keep (GGUF)
    quantize_block: int = 64


def _key(cfg) -> str:
    return f"algo.distill.teacher={cfg.algo.distill.teacher!r}"


def workdir_tokenizer(cfg, workdir: str):
    """The tokenizer a run used (as ``setup.make_tokenizer`` chose it, read-only)."""
    t = cfg.tokenizer
    path = t.path or (cfg.model.path if t.kind != "char" else "")
    if path:
        return tokenizers.load(path)
    if os.path.isfile(os.path.join(workdir, tokenizers.CHAR_TOKENIZER_FILE)):
        return tokenizers.CharTokenizer.load(workdir)
    return tokenizers.CharTokenizer()


def student_tokenizer(cfg):
    """The student's tokenizer as a fresh run builds it (no workdir is written)."""
    t = cfg.tokenizer
    path = t.path or (cfg.model.path if t.kind != "char" else "")
    return tokenizers.load(path) if path else tokenizers.CharTokenizer()


def _saved_steps(workdir: str) -> list[int]:
    directory = ckpt_lib.checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isfile(os.path.join(directory, n,
                                                                 "commit_success.txt")))


def resolve(cfg) -> Source:
    """The teacher named by ``algo.distill.teacher``, read without loading any weights, kept
    quantized as ``algo.distill.teacher_quantize`` says (one scale per
    ``model.quantize_block`` inputs)."""
    source = _resolve(cfg)
    qtype = cfg.algo.distill.get("teacher_quantize", "")
    if qtype == "keep" and source.kind != "gguf":
        raise ConfigError(f"algo.distill.teacher_quantize='keep' keeps a GGUF file's own "
                          f"quantized blocks: {_key(cfg)} is not a .gguf file (int8, int4 or "
                          "nf4 quantize any teacher at load)")
    return dataclasses.replace(source, quantize=qtype,
                               quantize_block=int(cfg.model.get("quantize_block", 64)))


def _resolve(cfg) -> Source:
    d = cfg.algo.distill
    # A relative path is the working directory's (as every other path of a config); absolute
    # from here on, since orbax restores absolute paths only.
    path = os.path.abspath(os.path.expanduser(os.fspath(d.teacher)))
    if not os.path.exists(path):
        raise UserError(f"{_key(cfg)} does not exist (looked for {path})")
    if d.teacher_step and not (os.path.isdir(path) and is_run_dir(path)):
        raise ConfigError(f"algo.distill.teacher_step={d.teacher_step} picks a checkpoint of "
                          f"an rljax workdir; {_key(cfg)} is not one")
    try:
        if models.is_gguf_path(path):
            models.inspect_gguf(path)
            return Source("gguf", path, tokenizers.load(path), cfg.model.dtype)
        if os.path.isdir(path) and is_run_dir(path):
            return _resolve_workdir(cfg, path)
        if os.path.isfile(os.path.join(path, "config.json")):
            models.load_config(path)   # an unsupported architecture is refused here
            return Source("hf", path, tokenizers.load(path), cfg.model.dtype)
    except (ValueError, OSError) as e:
        raise UserError(f"{_key(cfg)}: {e}") from None
    raise UserError(f"{_key(cfg)} is neither an HF checkpoint directory (config.json), a GGUF "
                    "file nor an rljax workdir")


def _run_config(path: str):
    """The teacher run's ``config.json`` as written (validated when that run started); only
    its ``model`` and ``tokenizer`` sections are read. (Read here without ``rljax.config``,
    which looks algorithms up in the phase registry this module is below.)"""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
        cfg = ml_collections.ConfigDict({k: data[k] for k in ("model", "tokenizer")})
        for key in ("preset", "path", "dtype", "overrides", "adapter_path"):
            cfg.model[key]   # noqa: B018 - every key read below is there
        cfg.model.lora.rank   # noqa: B018
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"cannot read the run's config.json ({type(e).__name__}: {e})") from None
    return cfg


def _resolve_workdir(cfg, path: str) -> Source:
    return workdir_source(path, int(cfg.algo.distill.teacher_step), _key(cfg),
                          "algo.distill.teacher_step", what="the teacher")


def workdir_source(path: str, step: int, key: str, step_key: str,
                   what: str = "the model") -> Source:
    """An rljax workdir's checkpoint ``step`` (0 = the latest) as a frozen model (a distill
    teacher, a game opponent); ``key`` (``"name='path'"``) and ``step_key`` name the config
    keys in the one-line UserError of a workdir whose config.json is unreadable, that trained
    LoRA adapters, has no checkpoint or lacks ``step``. A relative ``path`` is the working
    directory's."""
    path = os.path.abspath(path)   # orbax restores absolute paths only
    try:
        tcfg = _run_config(path)
    except ValueError as e:
        raise UserError(f"{key}: {e}") from None
    if tcfg.model.lora.rank or tcfg.model.adapter_path:
        raise UserError(f"{key} trained LoRA adapters; export it first (rljax export "
                        f"--workdir ... --out DIR) and pass DIR as {what}")
    saved = _saved_steps(path)
    if not saved:
        raise UserError(f"{key} has no checkpoint")
    step = int(step) or saved[-1]
    if step not in saved:
        raise UserError(f"{step_key}={step} is not saved in {path} (saved steps: {saved})")
    return Source("workdir", path, workdir_tokenizer(tcfg, path), tcfg.model.dtype, tcfg,
                  os.path.join(ckpt_lib.checkpoint_dir(path), str(step)))


def _vocab(tok) -> list[str] | None:
    """Token strings by id, for comparing two tokenizers (None when not listable)."""
    if isinstance(tok, tokenizers.CharTokenizer):
        return list(tokenizers.CHAR_SPECIALS) + list(tok.alphabet)
    inner = getattr(tok, "hf_tokenizer", None)
    if inner is not None:
        by_id = {i: s for s, i in inner.get_vocab().items()}
        return [by_id.get(i, "") for i in range(len(inner))]
    return None


def tokenizer_mismatch(student, teacher) -> str | None:
    """How two tokenizers differ (kind, vocabulary size, first differing token, eos), or None
    when the teacher's token ids mean what the student's do."""
    if type(student) is not type(teacher):
        return (f"the student's tokenizer is a {type(student).__name__}, the teacher's a "
                f"{type(teacher).__name__}")
    if student.vocab_size != teacher.vocab_size:
        return (f"vocab size {student.vocab_size} (student) vs {teacher.vocab_size} "
                "(teacher)")
    a, b = _vocab(student), _vocab(teacher)
    if a is not None and b is not None and a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        return f"token id {i} is {a[i]!r} for the student, {b[i]!r} for the teacher"
    if student.eos_id != teacher.eos_id:
        return f"eos id {student.eos_id} (student) vs {teacher.eos_id} (teacher)"
    return None


def check(cfg, student=None) -> Source:
    """``resolve`` plus the same-tokenizer check and ``check_fits``: one UserError line naming
    the problem, before any model is built (and before an SFT warm-up is paid for). Returns
    the source."""
    source = resolve(cfg)
    student = student_tokenizer(cfg) if student is None else student
    problem = tokenizer_mismatch(student, source.tokenizer)
    if problem:
        raise UserError(f"{_key(cfg)} does not share the student's tokenizer: {problem}")
    check_fits(source, _key(cfg))
    student_rows = _student_vocab(cfg, student)
    teacher_rows = model_config(source).vocab_size
    if student_rows is not None and student_rows != teacher_rows:
        # Padded embeddings (Qwen2.5 sizes): ids past the tokenizer that one head has and the
        # other not would score NaN, and every update would then be skipped.
        raise UserError(f"{_key(cfg)}: the teacher's head has {teacher_rows} rows, the "
                        f"student's {student_rows} (their shared tokenizer has "
                        f"{student.vocab_size} tokens); distillation needs the same vocab_size "
                        "(set model.overrides.vocab_size of the student to the teacher's)")
    return source


def _saved_param_shapes(step_dir: str) -> dict:
    """{key path: shape} of the ``params`` a workdir checkpoint holds, from orbax's metadata
    (no array is read)."""
    import logging

    import orbax.checkpoint as ocp
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)   # "_CHECKPOINT_METADATA does not exist" for the item dir
    try:
        meta = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, ckpt_lib.STATE_ITEM))
    finally:
        absl.setLevel(level)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return {jax.tree_util.keystr(k): tuple(v.shape)
            for k, v in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}


def check_fits(source: Source, key: str) -> None:
    """The teacher's architecture is readable, its head covers its tokenizer's ids and (an
    rljax workdir) the checkpoint's parameters have the shapes its config.json describes:
    what ``load`` would otherwise find out only after the warm-up. Reads metadata only."""
    try:
        model_cfg = model_config(source)
    except (ValueError, OSError, TypeError, KeyError) as e:
        raise UserError(f"{key}: its model config cannot be read ({e})") from None
    if model_cfg.vocab_size < source.tokenizer.vocab_size:
        raise UserError(f"{key}: its model's vocab_size {model_cfg.vocab_size} is smaller than "
                        f"its tokenizer's {source.tokenizer.vocab_size}")
    if source.kind != "workdir":
        return
    try:
        saved = _saved_param_shapes(source.step_dir)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"teacher checkpoint {source.step_dir} cannot be read: {first}") from None
    shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    want = {jax.tree_util.keystr(k): tuple(v.shape)
            for k, v in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    for name in sorted(set(saved) | set(want)):
        if saved.get(name) != want.get(name):
            raise UserError(
                f"teacher checkpoint {source.step_dir} does not fit "
                f"{os.path.join(source.path, 'config.json')}: params{name} is "
                f"{saved.get(name, 'missing')} in the checkpoint, "
                f"{want.get(name, 'absent')} by the config")


def _student_vocab(cfg, tok) -> int | None:
    """The student's head rows as a fresh run builds it (its config only; None when that
    cannot be read here: the student's own checks report it)."""
    m = cfg.model
    try:
        if m.path:
            return int(models.load_config(m.path, **dict(m.overrides)).vocab_size)
        return int(dict(m.overrides).get("vocab_size", tok.vocab_size))
    except Exception:  # noqa: BLE001 - a broken student path is reported by its own check
        return None


# ----------------------------------------------------------------------------- weights

def model_config(source: Source) -> models.ModelConfig:
    """The teacher's architecture (no weights read)."""
    dtype = jnp.dtype(source.dtype)
    if source.kind != "workdir":
        return models.load_config(source.path, dtype=dtype)
    m, tok = source.cfg.model, source.tokenizer
    if m.path:
        return models.load_config(m.path, dtype=dtype, **dict(m.overrides))
    overrides = {"vocab_size": tok.vocab_size, "dtype": m.dtype, "param_dtype": m.dtype,
                 "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
                 "bos_token_id": tok.bos_id, **dict(m.overrides)}
    return models.get_preset(m.preset, **overrides)


def _shapes_and_axes(model_cfg, source: Source | None):
    if source is not None and source.quantize:
        shapes, axes, _ = quantized.quantized_shapes(model_cfg, source.quantize,
                                                     source.quantize_block, source.path)
        return shapes, axes
    shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    return shapes, models.param_logical_axes(model_cfg)


def shardings(model_cfg, mesh, source: Source | None = None):
    """The teacher's parameter shardings: its own logical axes on the student's mesh (of
    its quantized tree when ``source.quantize`` is set)."""
    shapes, axes = _shapes_and_axes(model_cfg, source)
    return shd.logical_to_sharding(axes, mesh, shapes=shapes)


def abstract_params(model_cfg, mesh, source: Source | None = None):
    """``ShapeDtypeStruct`` leaves with shardings: the teacher as ``rljax plan`` sees it."""
    shapes, _ = _shapes_and_axes(model_cfg, source)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings(model_cfg, mesh, source))


def load(source: Source, mesh) -> tuple[models.ModelConfig, Any]:
    """(model config, sharded parameters) of the teacher. A workdir's checkpoint is verified
    against its manifest and only its ``params`` are read."""
    model_cfg = model_config(source)
    sh = shardings(model_cfg, mesh)
    transform, _ = quantized.make_quantizer(model_cfg, mesh, sh, source.quantize,
                                            source.quantize_block, source.path)
    if source.kind != "workdir":
        model_cfg, params = models.load_hf(source.path, dtype=jnp.dtype(source.dtype),
                                           shardings=sh, transform=transform)
        return model_cfg, params
    problem = manifest.verify_step_dir(source.step_dir)
    if problem is not None:
        raise UserError(f"teacher checkpoint {source.step_dir}: {problem}")
    import orbax.checkpoint as ocp

    target = {"params": abstract_params(model_cfg, mesh)}
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
    try:
        out = ocp.PyTreeCheckpointer().restore(
            os.path.join(source.step_dir, ckpt_lib.STATE_ITEM),
            args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                        partial_restore=True))
    except (ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"teacher checkpoint {source.step_dir} cannot be restored: "
                        f"{first}") from None
    if transform is not None:
        return model_cfg, quantized.quantize_tree(transform, out["params"])
    return model_cfg, out["params"]


# ----------------------------------------------------------------------------- scoring

def fields(cfg, n: int) -> dict:
    """The update batch's teacher fields: {name: (shape after the row axis, dtype)}."""
    d = cfg.algo.distill
    out = {"teacher_logps": ((n,), jnp.float32)}
    if d.jsd_weight > 0:
        k = int(d.top_k)
        out.update(teacher_topk_logps=((n, k), jnp.float32), teacher_topk_ids=((n, k), jnp.int32))
    return out


def build_score_fn(model_cfg, *, vocab: int, temperature: float = 1.0, top_k: int = 0,
                   num_micro: int = 1, mesh=None, param_shardings=None):
    """Jitted ``fn(params, batch) -> dict`` over the completion columns N of ``batch``
    (``tokens``/``mask`` [B, P+N], ``loss_mask`` [B, N]):

        teacher_logps      f32 [B, N]     log pi_T of each sampled token (0 on padding)
        teacher_argmax     i32 [B, N]     the teacher's most likely token
        teacher_topk_logps f32 [B, N, k]  with ``top_k``: its k most likely tokens' log-probs
        teacher_topk_ids   i32 [B, N, k]  and their ids

    Scored at ``temperature`` (``algo.distill.teacher_temperature``) over the first ``vocab``
    ids (the ids the student's head has too: a larger teacher head's padding never enters),
    ``num_micro`` row-chunks at a time to bound the [B, N, V] logits."""
    temperature = models.scoring_temperature(temperature)

    def one(params, mb):
        n = mb["loss_mask"].shape[1]
        hidden, _ = models.trunk(model_cfg, params, mb["tokens"], attention_mask=mb["mask"])
        logits = models.logits_from_hidden(model_cfg, params, hidden[:, -n - 1:-1])
        logp_all = jax.nn.log_softmax(logits[..., :vocab].astype(jnp.float32) / temperature)
        tok = mb["tokens"][:, -n:]
        real = mb["mask"][:, -n:]
        picked = jnp.take_along_axis(logp_all, tok[..., None], axis=-1)[..., 0]
        out = {"teacher_logps": jnp.where(real, picked, 0.0),
               "teacher_argmax": jnp.argmax(logp_all, axis=-1).astype(jnp.int32)}
        if top_k:
            vals, ids = jax.lax.top_k(logp_all, top_k)
            out.update(teacher_topk_logps=vals, teacher_topk_ids=ids.astype(jnp.int32))
        return out

    def score(params, batch):
        batch = {k: batch[k] for k in ("tokens", "mask", "loss_mask")}
        if num_micro == 1:
            return one(params, batch)
        out = jax.lax.map(lambda mb: one(params, mb), steps.split_micro_batches(batch, num_micro))
        b = batch["tokens"].shape[0]
        return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((b,) + x.shape[2:]), out)

    options = compilation_cache.training_compiler_options()
    if mesh is None:
        return jax.jit(score, compiler_options=options)
    return jax.jit(score, in_shardings=(param_shardings, steps.batch_sharding(mesh)),
                   out_shardings=steps.batch_sharding(mesh), compiler_options=options)
