"""Memory plan: compile every phase of a run for its mesh, without running it or allocating it.

    rljax plan --config configs/grpo_arithmetic.py [--config.KEY=VALUE ...]

Each phase states the programs its iterations run (``programs(ctx, steps)``,
``rljax.train.core.programs``), built by the builders training uses: ``sample`` (the on-device
sampler), ``eval`` (the held-out evaluation's sampler at ``eval.batch_size`` /
``eval.max_new_tokens``), ``logps`` (old / reference log-probs), ``prepare`` (PPO: values and
GAE), ``update`` (one optimizer step on a mini-batch; GRPO: one micro-batch's gradients per
update stream, then ``apply``, the optimizer step on their sums); an SFT warm-up's are named
``sft_*``. Each is lowered with abstract inputs (``jax.ShapeDtypeStruct`` carrying the run's
shardings; no parameter is ever materialised) at its worst-case shapes (the longest prompt
bucket, the full completion slot), compiled, and XLA's ``compiled.memory_analysis()`` gives
its per-device arguments, outputs, aliased (donated) bytes and temporaries.

A phase's per-device peak is estimated as

    resident + copies x (arguments - resident arguments + outputs - aliased + temporaries)
             + code

where *resident* is what lives on the device for the whole phase (the train state: policy,
optimizer state, frozen reference, critic; and a game's checkpoint opponent), counted once
whether or not the program takes it as an argument, and *copies* the instances running at once
(``algo.update_streams``).
The peak is compared with the device's memory: ``memory.device_memory_gb`` when set, else the
allocator limit from ``device.memory_stats()`` (GPU/TPU), else, on CPU, the host's RAM shared
by its local devices. ``rljax train`` runs the same check first (``memory.check``) and stops
with one clear line when a run cannot fit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax import cost as cost_lib
from rljax import models
from rljax import sharding as shd
from rljax.errors import ConfigError, UserError
from rljax.train.core.programs import shard_bytes

GiB = float(1 << 30)
MiB = float(1 << 20)


class DoesNotFit(UserError):
    """The configured run needs more memory per device than the device has."""


@dataclasses.dataclass
class PhaseMemory:
    """Per-device bytes of one compiled phase (from ``compiled.memory_analysis()``)."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temps: int
    code: int
    resident_arguments: int      # part of ``arguments`` that is resident train state
    compile_s: float = 0.0
    copies: int = 1              # instances running at once (update streams)
    cost: Any = None             # cost.ProgramCost of one call (``plan(..., cost=True)``)

    def peak(self, resident: int) -> int:
        return (resident + self.copies * (self.arguments - self.resident_arguments
                                          + self.outputs - self.aliased + self.temps)
                + self.code)


@dataclasses.dataclass
class MemoryPlan:
    """The plan of one config: resident state, phases, and the device's capacity."""

    description: str
    resident: int                # per-device bytes of the train state (largest phase's)
    resident_parts: dict         # name -> per-device bytes
    phases: list                 # PhaseMemory
    capacity: int | None         # per-device bytes available, None = unknown
    capacity_source: str
    notes: list = dataclasses.field(default_factory=list)
    chip: str | None = None      # ``rljax plan --cost CHIP``: the roofline's chip

    @property
    def peak(self) -> int:
        return max([p.peak(self.resident) for p in self.phases] or [self.resident])

    @property
    def peak_phase(self) -> str:
        if not self.phases:
            return "state"
        return max(self.phases, key=lambda p: p.peak(self.resident)).name

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def to_dict(self) -> dict:
        return {"description": self.description, "resident_bytes": self.resident,
                "resident_parts": self.resident_parts, "peak_bytes": self.peak,
                "peak_phase": self.peak_phase, "capacity_bytes": self.capacity,
                "capacity_source": self.capacity_source, "fits": self.fits,
                "phases": [self._phase_dict(p) for p in self.phases], "notes": self.notes,
                "chip": self.chip}

    def _phase_dict(self, p: PhaseMemory) -> dict:
        out = dict(dataclasses.asdict(p), peak=p.peak(self.resident))
        if self.chip is not None and p.cost is not None:
            out["roofline_s"], out["bound"] = cost_lib.roofline(p.cost, self.chip)
        return out

    def format(self) -> str:
        lines = [self.description, "per-device memory (MiB):",
                 f"  {'phase':<15}{'arguments':>11}{'outputs':>10}{'aliased':>10}{'temps':>10}"
                 f"{'peak':>10}   (compile)"]
        for p in self.phases:
            name = p.name if p.copies == 1 else f"{p.name} x{p.copies}"
            lines.append(f"  {name:<15}{p.arguments / MiB:>11.1f}{p.outputs / MiB:>10.1f}"
                         f"{p.aliased / MiB:>10.1f}{p.temps / MiB:>10.1f}"
                         f"{p.peak(self.resident) / MiB:>10.1f}   ({p.compile_s:.1f}s)")
        parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in self.resident_parts.items())
        lines.append(f"  resident train state {self.resident / MiB:.1f} MiB ({parts})")
        lines.append("  peak = resident state + the phase's other arguments + outputs - aliased "
                     "+ temporaries (x N: N at once)")
        lines += [f"  note: {n}" for n in self.notes]
        if self.chip is not None:
            lines.append(cost_lib.format_costs(
                [(p.name, p.cost) for p in self.phases if p.cost is not None], self.chip))
        if self.capacity is None:
            lines.append(f"device memory unknown ({self.capacity_source}): peak "
                         f"{human(self.peak)} in {self.peak_phase}")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"device memory {human(self.capacity)} ({self.capacity_source}); "
                         f"peak {human(self.peak)} in {self.peak_phase} "
                         f"({100 * self.peak / max(self.capacity, 1):.1f}%): {verdict}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- helpers

def human(n: float) -> str:
    """Bytes as ``1.5 GiB`` / ``12.3 MiB`` / ``4.0 KiB``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024.0)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


def _compile_phase(program, cost: bool = False) -> PhaseMemory:
    """Lowers and compiles one ``programs.Program``; XLA's memory analysis of it (and with
    ``cost``, its cost analysis: ``cost.program_cost``)."""
    t0 = time.perf_counter()
    compiled = program.fn.lower(*program.args).compile()
    stats = compiled.memory_analysis()
    dt = time.perf_counter() - t0
    if stats is None:
        raise RuntimeError(f"XLA gave no memory analysis for {program.name} on "
                           f"{jax.default_backend()}")
    return PhaseMemory(
        name=program.name, arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes), aliased=int(stats.alias_size_in_bytes),
        temps=int(stats.temp_size_in_bytes), code=int(stats.generated_code_size_in_bytes),
        resident_arguments=program.resident, compile_s=dt, copies=program.copies,
        cost=cost_lib.program_cost(compiled) if cost else None)


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_capacity(cfg, device=None) -> tuple[int | None, str]:
    """(bytes per device, where the number comes from)."""
    gb = float(_memory_cfg(cfg).get("device_memory_gb", 0.0) or 0.0)
    if gb > 0:
        return int(gb * GiB), "memory.device_memory_gb"
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
    if limit:
        return int(limit), f"{device.device_kind} allocator limit"
    if device.platform == "cpu":
        ram = host_memory_bytes()
        if ram:
            n = jax.local_device_count()
            return ram // n, f"host RAM / {n} local CPU device{'s' if n > 1 else ''}"
    return None, f"{device.platform} reports no memory limit; set memory.device_memory_gb"


def _memory_cfg(cfg) -> dict:
    return dict(cfg.memory) if "memory" in cfg else {}


# ----------------------------------------------------------------------------- model / state

def _lora_rank(cfg) -> int:
    """The run's LoRA rank (``model.lora.rank``, or the adapter's ``r``); 0 = LoRA off."""
    if cfg.model.adapter_path:
        with open(os.path.join(cfg.model.adapter_path, models.peft.ADAPTER_CONFIG)) as f:
            return int(json.load(f)["r"])
    return int(cfg.model.lora.rank)


def model_config(cfg, tokenizer) -> models.ModelConfig:
    """The run's ModelConfig without loading or creating weights (as ``setup.build_model``)."""
    m = cfg.model
    if m.path and m.vision.load:   # the text model and its vision tower
        from rljax.models import hf_vision
        return hf_vision.vlm_config(m.path, dtype=jnp.dtype(m.dtype), remat=bool(m.remat),
                                    train_vision=bool(m.vision.train), **dict(m.overrides))[0]
    if m.path:
        return models.load_config(m.path, dtype=jnp.dtype(m.dtype), remat=bool(m.remat),
                                  **dict(m.overrides))
    overrides = {"vocab_size": tokenizer.vocab_size, "dtype": m.dtype, "param_dtype": m.dtype,
                 "remat": bool(m.remat), "eos_token_id": tokenizer.eos_id,
                 "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id}
    if models.PRESETS.get(m.preset, {}).get("vision") is not None:
        from rljax.train.core.setup import image_token_id
        overrides.update(image_token_id=image_token_id(cfg, tokenizer),
                         train_vision=bool(m.vision.train))
    overrides.update(dict(m.overrides))
    try:
        return models.get_preset(m.preset, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None


def _tokenizer(cfg):
    from rljax.train.core.setup import make_tokenizer
    return make_tokenizer(cfg, None)


# ----------------------------------------------------------------------------- the plan

def resident_parts(state) -> dict:
    """Per-device bytes of an abstract train state by part: ``params`` (with LoRA the frozen
    base; ``adapters`` apart), ``optimizer`` (and the step counter and rng), ``reference``,
    ``critic``, ``critic_optimizer``."""
    parts = {"params": shard_bytes(state.params),
             "optimizer": shard_bytes((state.opt_state, state.step, state.rng))}
    if models.lora.has_lora(state.params):
        parts["adapters"] = shard_bytes(state.params["lora"])
        parts["params"] -= parts["adapters"]
    for key, field in (("reference", "ref_params"), ("critic", "critic_params"),
                       ("critic_optimizer", "critic_opt_state")):
        if getattr(state, field) is not None:
            parts[key] = shard_bytes(getattr(state, field))
    return parts


def abstract_context(cfg, devices) -> tuple[Any, int]:
    """``(setup.Context, parameter count)`` of the run on ``devices`` (after ``check_inputs``)
    with abstract parameters (``ShapeDtypeStruct`` leaves carrying the run's shardings): what
    the phases' ``programs`` take. Nothing is loaded or allocated."""
    from rljax.train.core.setup import Context, check_inputs, make_meshes, quantized_base

    check_inputs(cfg, len(devices))
    mesh, rollout_mesh = make_meshes(cfg, devices)
    tok = _tokenizer(cfg)
    mcfg = model_config(cfg, tok)
    param_shapes = jax.eval_shape(lambda: models.init_params(mcfg, jax.random.key(0)))
    axes = models.param_logical_axes(mcfg)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes))
    if cfg.model.get("quantize", ""):   # the frozen base as it is kept (models.quant)
        param_shapes, axes, _ = quantized_base(cfg, mcfg)
    lora_rank = _lora_rank(cfg)
    if lora_rank:  # frozen base + float32 adapters; no optimizer state or copy for the base
        lc = cfg.model.lora
        mcfg = mcfg.replace(lora_scale=float(lc.alpha) / lora_rank,
                            lora_dropout=float(lc.dropout))  # the masks are planned too
        param_shapes = {**param_shapes, "lora": jax.eval_shape(
            lambda: models.lora.init_lora(mcfg, lora_rank, lc.targets, jax.random.key(0)))}
        axes = {**axes, "lora": models.lora.lora_logical_axes(mcfg, lora_rank, lc.targets)}
    param_sh = shd.logical_to_sharding(axes, mesh, shapes=param_shapes)
    rollout_sh = (None if rollout_mesh is None else
                  shd.on_mesh(param_sh, param_shapes, rollout_mesh))
    return Context(cfg, "", mesh, tok, mcfg, _abstract(param_shapes, param_sh), param_sh,
                   rollout_mesh=rollout_mesh, rollout_shardings=rollout_sh), n_params


def plan(cfg, devices=None, *, compile_phases: bool = True, chip: str | None = None,
         moe_balanced: bool = True, programs: Callable[[str], bool] | None = None) -> MemoryPlan:
    """Compiles the programs of the run's phases abstractly (each phase states its own:
    ``rljax.train.phases.phase_programs``) and returns their per-device memory.

    ``compile_phases=False`` only sizes the resident train state (no compile; seconds faster).
    ``chip`` (a ``cost.CHIPS`` name): also each program's per-device cost and its roofline
    time on that chip. ``moe_balanced``: a mixture of experts' grouped matmuls are compiled
    as ``moe_dispatch.bucketed_ffn``, at a grouped matmul's cost for a balanced load
    (``ModelConfig.moe_plan_balanced``); False (``check``): as training compiles them.
    ``programs``: compile only the programs whose name it accepts (e.g. the updates alone);
    the others are left out of the plan.
    """
    if chip is not None and chip not in cost_lib.CHIPS:
        raise UserError(f"--cost {chip}: unknown chip; one of {', '.join(cost_lib.CHIPS)}")
    from rljax.train import phases as phases_lib
    from rljax.train.core import programs as programs_lib

    devices = list(jax.devices() if devices is None else devices)
    ctx, n_params = abstract_context(cfg, devices)
    mesh, rollout_mesh = ctx.mesh, ctx.rollout_mesh
    phases: list[PhaseMemory] = []
    notes: list[str] = []
    residents: list[tuple[str, dict]] = []
    samples = False
    p_len, n_new = programs_lib.prompt_len(cfg), programs_lib.completion_len(cfg)
    if moe_balanced and ctx.model_cfg.num_experts:
        ctx = dataclasses.replace(ctx, model_cfg=ctx.model_cfg.replace(moe_plan_balanced=True))
        notes.append(_moe_note(ctx.model_cfg))
    if cfg.env.name:
        notes.append(f"episodes: sampling planned as one sampler pass over the multi-turn "
                     f"KV cache ({programs_lib.sampler_len(cfg)} slots after the prompt); "
                     f"training sequences {p_len} + env.max_total_tokens = {p_len + n_new}")
    if rollout_mesh is not None:
        notes.append(f"mesh.rollout_devices={rollout_mesh.size}: the sample programs are "
                     "planned on the rollout mesh ("
                     + _mesh_text(rollout_mesh)
                     + ") with the sampler's copy of the policy as their resident state; "
                     "the others on the training mesh")
    if cfg.rollout.engine == "slots" and mesh.size > 1:
        notes.append("rollout.engine='slots': the engine's pages, slots and outputs are "
                     "planned whole on every device (it does not split them over the mesh)")
    for name, state, progs in phases_lib.phase_programs(ctx):
        if progs is None:
            notes.append(f"the {name} phase states no programs (register_algorithm(..., "
                         f"programs=...)): not planned")
            continue
        residents.append((name, {**resident_parts(state),
                                 **programs_lib.sampler_copies(ctx, name, state),
                                 **programs_lib.held_parts(progs)}))
        if any(p.name.split("/")[0] == "sample" for p in progs):
            samples = True
        if compile_phases:
            phases += [_compile_phase(p, cost=chip is not None) for p in progs
                       if programs is None or programs(p.name)]
    if samples:
        notes.append(programs_lib.kv_cache_note(ctx, human))
    if not compile_phases:
        notes.append("phases not compiled: resident train state only")
    name, parts = max(residents, key=lambda x: sum(x[1].values()), default=("", {}))
    capacity, source = device_capacity(cfg, devices[0])
    mesh_desc = _mesh_text(mesh)
    description = (f"rljax plan: {cfg.algo.name}{' + sft warm-up' if cfg.sft.steps else ''}, "
                   f"model {cfg.model.path or cfg.model.preset} ({n_params / 1e6:.3g}M params, "
                   f"{cfg.model.dtype}), mesh {mesh_desc} ({len(devices)} "
                   f"{devices[0].platform} devices, {jax.process_count()} process"
                   f"{'es' if jax.process_count() > 1 else ''}); prompts <= {p_len} tokens, "
                   f"completions {n_new}")
    return MemoryPlan(description, sum(parts.values()), parts, phases, capacity, source, notes,
                      chip=chip)


def _moe_note(mcfg) -> str:
    """The plan's note on how a mixture of experts' expert matmuls and dispatch are planned."""
    f = mcfg.moe_capacity_factor
    buffers = (f"at moe_capacity_factor={f:g}" if f > 0 else
               "dropless, sized for the worst case (n x min(k, experts per device) rows per "
               "destination)")
    return ("MoE expert matmuls planned at a balanced load: each device's experts run as "
            "grouped matmuls over the n x k rows a balanced batch sends them (n tokens per "
            "device, k experts per token; capacity factor 1 per expert), not XLA:CPU's masked "
            f"dense ragged_dot; the dispatch's buffers and all-to-all as run: {buffers}")


def _mesh_text(mesh) -> str:
    """``data=8 fsdp=1 tensor=1``: the mesh's axis sizes (``expert`` only when it splits)."""
    return " ".join(f"{k}={v}" for k, v in mesh.shape.items() if k != "expert" or v > 1)

def explain(p: MemoryPlan) -> str:
    """One line: why the run cannot fit, and what to change."""
    phase = next(x for x in p.phases if x.name == p.peak_phase) if p.phases else None
    if phase is not None:
        what = (f"phase '{p.peak_phase}' needs {human(p.peak)} per device (resident state "
                f"{human(p.resident)}, other inputs "
                f"{human(phase.arguments - phase.resident_arguments)}, outputs "
                f"{human(phase.outputs - phase.aliased)}, temporaries {human(phase.temps)})")
    else:
        what = (f"the train state alone ({', '.join(p.resident_parts)}) needs "
                f"{human(p.resident)} per device")
    return (f"the run does not fit: {what} but a device has {human(p.capacity)} "
            f"({p.capacity_source}). Shard more (mesh.fsdp / mesh.tensor), use smaller "
            f"algo.micro_batch_size / rollout.micro_batch_size / eval.batch_size, "
            f"model.remat=true or "
            f"model.dtype=bfloat16; `rljax plan --config ...` shows every phase")


# Every token of a batch the trainer holds costs at least its id (int32) and its log-prob
# (float32) on the host; masks, advantages, device copies and activations come on top.
HOST_BYTES_PER_TOKEN = 8


def batch_sizes(cfg) -> list[tuple[str, int, int]]:
    """``[(what, rows, tokens per row)]`` of the batches a run holds at once: the rollout
    (``rollout.batch_size`` completions of up to ``data.max_prompt_length +
    rollout.max_new_tokens`` tokens), the eval batch, the SFT warm-up's batch."""
    rl_tokens = int(cfg.data.max_prompt_length) + int(cfg.rollout.max_new_tokens)
    out = [("rollout.batch_size", int(cfg.rollout.batch_size), rl_tokens)]
    if "eval" in cfg:
        eval_new = int(cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
        out.append(("eval.batch_size", int(cfg.eval.batch_size) * int(cfg.eval.num_samples),
                    int(cfg.data.max_prompt_length) + eval_new))
    if "sft" in cfg and cfg.sft.steps:
        out.append(("sft.batch_size", int(cfg.sft.batch_size), int(cfg.sft.max_length)))
    return out


def check_sizes(cfg, host_bytes: int | None = None) -> None:
    """Raises :class:`DoesNotFit` (one line) for a batch that cannot fit whatever else the run
    does. Rule: rows x tokens per row x ``HOST_BYTES_PER_TOKEN`` (8) bytes -- a floor, a
    run needs more -- must not exceed this host's RAM (``host_bytes``; default: physical
    memory) times the number of hosts. Costs nothing: no model, no compile."""
    ram = host_memory_bytes() if host_bytes is None else host_bytes
    if not ram:
        return
    ram *= max(1, jax.process_count())
    for key, rows, tokens in batch_sizes(cfg):
        need = rows * tokens * HOST_BYTES_PER_TOKEN
        if need > ram:
            raise DoesNotFit(
                f"{key}={rows} cannot fit: {rows} rows x {tokens} tokens x "
                f"{HOST_BYTES_PER_TOKEN} bytes (token ids and log-probs alone) = {human(need)} "
                f"> {human(ram)} of host memory; lower {key}")


def check(cfg, devices=None, *, verbose: bool = False) -> MemoryPlan | None:
    """``rljax train``'s pre-flight check; raises :class:`DoesNotFit` (one clear line).

    First, whatever ``memory.check`` says, :func:`check_sizes` refuses a batch too large for
    the host's memory (e.g. ``rollout.batch_size: 1000000000000``).

    ``memory.check``: ``"full"`` always compiles the phases; ``"auto"`` does so on GPU/TPU or when
    ``memory.device_memory_gb`` is set, and on a plain CPU run only checks that the resident
    train state fits (no compile, so the first step's compile time is not doubled);
    ``"off"`` skips it.
    """
    check_sizes(cfg)
    mode = _memory_cfg(cfg).get("check", "auto")
    if mode == "off":
        return None
    devices = list(jax.devices() if devices is None else devices)
    explicit = float(_memory_cfg(cfg).get("device_memory_gb", 0.0) or 0.0) > 0
    full = mode == "full" or explicit or devices[0].platform != "cpu"
    # The programs as this run compiles them (moe_balanced=False: the real grouped matmuls).
    p = plan(cfg, devices, compile_phases=False, moe_balanced=False)  # seconds: state too big?
    if p.fits and full:
        p = plan(cfg, devices, moe_balanced=False)
    if verbose and jax.process_index() == 0:
        print(p.format(), file=sys.stderr, flush=True)
    if not p.fits:
        raise DoesNotFit(explain(p))
    return p


def run(cfg, devices=None, *, as_json: bool = False, chip: str | None = None) -> int:
    """``rljax plan``: prints the plan; exit code 0 if it fits, 1 if not. ``chip``: also the
    programs' costs and roofline times on that chip (``rljax plan --cost CHIP``)."""
    from rljax import compilation_cache, distributed
    distributed.initialize()  # on a pod, plan for the global mesh
    compilation_cache.from_config(cfg)
    p = plan(cfg, devices, chip=chip)
    if jax.process_index() == 0:
        print(json.dumps(p.to_dict(), indent=2) if as_json else p.format(), flush=True)
        if not p.fits:
            print(f"rljax: {explain(p)}", file=sys.stderr, flush=True)
    return 0 if p.fits else 1


def measure_live_bytes() -> int:
    """Bytes of all live jax arrays on the first local device (for checking a plan)."""
    device = jax.local_devices()[0]
    total = 0
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            if shard.device == device:
                total += models.quant.nbytes(shard.data.shape, shard.data.dtype)
    return total


__all__ = ["plan", "abstract_context", "check", "run", "explain", "MemoryPlan", "PhaseMemory",
           "DoesNotFit", "device_capacity", "shard_bytes", "model_config", "measure_live_bytes"]
