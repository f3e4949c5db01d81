"""One full GRPO iteration: rljax vs TRL's GRPOTrainer (PyTorch CPU) vs Tunix (JAX CPU).

An iteration is: sample G completions for each of B prompts, score them (host reward), group
advantages, one AdamW update over all B*G completions. All three frameworks run the *same*
random llama checkpoint (created with ``transformers``, ``save_pretrained`` into a temp dir; TRL
and rljax load it, Tunix loads the same safetensors into its own llama3 module), the same
offline byte-level tokenizer (BOS + 31 prompt bytes = 32 prompt tokens), the same prompts (the
first B GSM8K questions cut to 31 characters), G, N new tokens (exactly N everywhere: TRL with
``min_new_tokens = N``, Tunix and rljax with EOS stopping disabled -- Tunix's ``eos_tokens`` and
rljax's tokenizer ``eos_id`` set to an id the model cannot produce), temperature 1, AdamW
(lr 1e-5, no weight decay, grad-norm clip 1.0), beta = 0 (no reference model), one epoch and one
micro-batch per iteration, and a trivial reward (fraction of 'e' in the completion).

    python bench/grpo_step.py                      # comparison + scaling table, ~10 minutes
    python bench/grpo_step.py --shapes base,small --no-scaling
    python bench/grpo_step.py --peers none         # rljax only

Peers run in their own virtual environments (``--trl-python``, ``--tunix-python``; defaults
``/work/peers/{trl,tunix}/bin/python``) through the runners in ``bench/peers/``; a peer that is
missing or fails is recorded with its error text. rljax runs ``--worker`` subprocesses of this
script that drive the trainer's own GRPO phase (``rljax.train``: build_context ->
make_phases -> start_phase -> ``phase.iteration``), i.e. exactly the controller's loop body
without logging/eval/checkpointing.

Reported per framework: first iteration (compile/warm-up) seconds, median seconds per iteration
over ``--iters`` further iterations, generated tokens/s (B*G*N / iteration time), and the
sample/update split. For rljax also: XLA compilations after the first iteration (jax.monitoring
``backend_compile`` events; must be 0) and the update step's achieved FLOP/s against this
machine's float32 matmul peak, measured in this script by a jitted 2048^3 matmul.

FLOP model (per forward pass of one sequence of S = P + N positions):
``2 * S * W + 4 * L * S^2 * H * Dh`` where W = weights used in matmuls (all but the embedding
table; the LM head included) and the second term is causal attention computed densely (QK^T
and AV, as rljax and XLA do). Backward = 2x forward. The update step (grpo_step: forward +
backward + AdamW) does 3x; the old-logps pass before it, when there is one, does 1x (reported
separately; with one update per rollout the step uses its own forward's log-probs instead).

Writes ``bench/results/grpo_step.json`` and prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

PROMPT_CHARS = 31          # + BOS = 32 prompt tokens with the byte-level tokenizer
VOCAB = 259                # 256 bytes + <pad>, <bos>, <eos>
PAD, BOS, EOS = 256, 257, 258
REWARD_CHAR = "e"
LEARNING_RATE = 1e-5

# Model shapes (llama): rljax preset name + overrides.
SHAPES = {
    "tiny": ("tiny", {}),                                            # 2L, d64
    "base": ("tiny", dict(num_layers=4, hidden_size=128, intermediate_size=384,
                          num_heads=4, num_kv_heads=2)),             # 4L, d128
    "small": ("small", {}),                                          # 8L, d256
    # SmolLM2-135M's trunk (30L, d576) with the byte vocabulary: the GPU comparison's shape.
    "smollm2": ("tiny", dict(num_layers=30, hidden_size=576, intermediate_size=1536,
                             num_heads=9, num_kv_heads=3)),
}


def model_config(shape: str):
    from rljax import models
    preset, overrides = SHAPES[shape]
    return models.get_preset(preset, vocab_size=VOCAB, **overrides)


def shape_label(shape: str) -> str:
    c = model_config(shape)
    return f"{shape} ({c.num_layers}L-{c.hidden_size}, {c.num_params() / 1e6:.2f}M)"


# ----------------------------------------------------------------------------- shared setup

def write_tokenizer(out_dir: str) -> None:
    """Byte-level BPE without merges: ids 0..255 are bytes, then <pad>, <bos>, <eos>; a BOS is
    prepended on encode (post-processor), as every framework's prompt path then agrees."""
    import transformers
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<bos>", eos_token="<eos>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (PAD, BOS, EOS)
    fast.save_pretrained(out_dir)


def write_model(shape: str, out_dir: str, seed: int = 0) -> None:
    """A random HF LlamaForCausalLM of ``shape`` plus the tokenizer, in ``out_dir``."""
    import torch
    import transformers
    from rljax import models

    hf = models.config_to_hf(model_config(shape))
    hf.update(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).save_pretrained(out_dir)
    write_tokenizer(out_dir)


def gsm8k_path() -> str:
    """GSM8K's train split: ``$RLJAX_GSM8K/train.jsonl``, else ``data/gsm8k/train.jsonl`` under
    the working directory or this checkout (docs/data.md, "GSM8K")."""
    for root in (os.environ.get("RLJAX_GSM8K", ""), os.path.join("data", "gsm8k"),
                 os.path.join(ROOT, "data", "gsm8k")):
        path = os.path.join(root, "train.jsonl")
        if root and os.path.exists(path):
            return path
    raise FileNotFoundError("GSM8K train.jsonl not found: set RLJAX_GSM8K to a directory "
                            "holding train.jsonl, or put it in data/gsm8k/ (docs/data.md)")


def bench_prompts(b: int) -> list[str]:
    path = gsm8k_path()
    out = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)["question"]
            if len(q) >= PROMPT_CHARS and q.isascii():
                out.append(q[:PROMPT_CHARS])
            if len(out) == b:
                return out
    raise ValueError(f"not enough GSM8K questions in {path}")


def measure_matmul_peak(n: int = 2048, runs: int = 7) -> dict:
    """float32 FLOP/s of a jitted n x n x n matmul (median of ``runs`` after a warm-up)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"n": n, "seconds": t, "flops_per_s": 2 * n ** 3 / t, "best_flops_per_s": 2 * n ** 3 / min(times)}


def forward_flops(cfg, batch: int, seq: int, scored: int | None = None) -> float:
    """Matmul FLOPs of one forward pass over ``batch`` sequences of ``seq`` positions, the LM
    head counted at ``scored`` positions per sequence (default all ``seq``): a loss over the
    completion needs the head only there, and rljax's update runs it only there."""
    d, f, h, k, dh, v, layers = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers)
    weights = layers * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f)
    attention = 4 * layers * seq * seq * h * dh
    head = d * v * (seq if scored is None else scored)
    return batch * (2 * seq * weights + 2 * head + attention)


# ----------------------------------------------------------------------------- rljax worker

def rljax_worker(spec: dict) -> dict:
    """Times ``spec["iters"]`` GRPO iterations (after one warm-up) of the rljax trainer."""
    import jax
    import numpy as np

    from rljax import config as config_lib
    from rljax import rewards
    from rljax.train import inference
    from rljax.train import phases as phases_lib
    from rljax.train.core.setup import build_context, check_inputs

    char = spec["reward_char"]
    if spec.get("prompt_buckets") == "pow2":   # the trainer's buckets before quarter steps
        from rljax import sampling
        from rljax.train.core import rollout
        rollout.prompt_buckets = lambda m: tuple(  # noqa: E731
            x for x in sampling.DEFAULT_BUCKETS if x < m) + (int(m),)

    def char_fraction(**_):
        def fn(prompts, completions, **fields):
            return [c.count(char) / max(len(c), 1) for c in completions]
        return fn
    rewards.register("bench_char_fraction", char_fraction, overwrite=True)

    b, g, n = len(spec["prompts"]), spec["num_generations"], spec["max_new_tokens"]
    workdir = tempfile.mkdtemp(prefix="rljax_bench_")
    data_path = os.path.join(workdir, "prompts.jsonl")
    with open(data_path, "w") as f:
        for p in spec["prompts"]:
            f.write(json.dumps({"question": p}) + "\n")
    cfg = config_lib.default_config()
    cfg.seed = spec["seed"]
    cfg.steps = 1 + spec["iters"]
    cfg.model.path = spec["model_dir"]
    cfg.model.dtype = spec.get("dtype", "float32")
    if cfg.model.dtype != "float32":   # cuDNN's fused attention where it applies (GPU)
        cfg.model.overrides = {"attention_impl": "auto"}
    cfg.data.source, cfg.data.path = "jsonl", data_path
    # Default: BOS + 31 bytes = 32 tokens, as the peers (real-model bench: pre-rendered chat).
    cfg.data.template = spec.get("template", "<bos>{question}")
    cfg.data.max_prompt_length = spec["prompt_tokens"]
    cfg.data.shuffle = False
    cfg.rollout.batch_size = b * g
    cfg.rollout.max_new_tokens = n
    cfg.rollout.temperature = 1.0
    cfg.algo.name = "grpo"
    cfg.algo.num_generations = g
    cfg.algo.beta = 0.0
    cfg.algo.num_iterations = 1
    cfg.algo.loss_agg_mode = "token-mean"
    cfg.optimizer.name = "adamw"
    cfg.optimizer.learning_rate = spec["learning_rate"]
    cfg.optimizer.weight_decay = 0.0
    cfg.optimizer.max_grad_norm = 1.0
    cfg.algo.micro_batch_size = int(spec.get("micro_batch", 0))
    if "group_by_length" in spec:   # length-grouped micro-batches (rljax.train.core.length_groups)
        cfg.algo.group_by_length = bool(spec["group_by_length"])
    if "shared_prompt" in spec:   # each group's prompt computed once (rljax.models.shared_prompt)
        cfg.algo.shared_prompt = bool(spec["shared_prompt"])
    # Persistent compilation cache: off unless the spec names a directory (the bench runs a
    # cold process on an empty directory, then a second process on the same one).
    cfg.compilation_cache_dir = spec.get("compilation_cache_dir", "")
    cfg.compile_for = spec.get("compile_for", "throughput")
    cfg.reward.names = ("bench_char_fraction",)
    config_lib.validate(cfg)
    check_inputs(cfg)

    compiles: list[float] = []

    def on_event(name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)
    jax.monitoring.register_event_duration_secs_listener(on_event)

    t_start = time.perf_counter()
    from rljax import compilation_cache
    compilation_cache.from_config(cfg)   # as rljax.train.run does
    ctx = build_context(cfg, workdir)
    # EOS stopping off: an id the model cannot sample -> exactly N tokens.
    ctx.tokenizer.eos_id = ctx.model_cfg.vocab_size
    phase = phases_lib.make_phases(ctx)[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    jax.block_until_ready(state)
    t_setup = time.perf_counter() - t_start

    from rljax.train.run import setup_objects_frozen
    times, cpu_times, metrics_all, compiles_at = [], [], [], []
    with setup_objects_frozen():   # as rljax.train.run's loop
        for step in range(cfg.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            state, metrics = phase.iteration(state, step)
            jax.block_until_ready(state.params)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)   # all threads: robust to a busy machine
            metrics_all.append(metrics)
            compiles_at.append(len(compiles))
    first, steady = times[0], times[1:]
    it = statistics.median(steady)
    med = lambda key: statistics.median(m[key] for m in metrics_all[1:])  # noqa: E731
    update_s, logps_s = med("time/update"), med("time/logps")
    # One update per rollout: the step reuses its own forward as the old log-probs (no pass).
    old_logps_pass = bool(phase.rollout.old_logps)
    if not old_logps_pass:
        logps_s = 0.0
    sample_s, reward_s = med("time/sample"), med("time/reward")
    mcfg = ctx.model_cfg
    seq = int(metrics_all[-1].get("rollout/seq_len", spec["prompt_tokens"] + n))
    fwd = forward_flops(mcfg, b * g, seq, scored=n)   # the head runs on completions only
    lengths = [m["completion/length_mean"] for m in metrics_all]
    return {
        "framework": "rljax", "versions": {"jax": jax.__version__},
        "first_iter_s": first, "setup_s": t_setup, "iter_s": it, "iter_s_all": steady,
        # Process CPU seconds of the first iteration (every thread): with C cores no schedule
        # of the same compiles and runs can take under first_iter_cpu_s / C of wall time.
        "first_iter_cpu_s": cpu_times[0],
        "iter_cpu_s": statistics.median(cpu_times[1:]), "iter_cpu_s_all": cpu_times[1:],
        "sample_s": sample_s, "reward_s": reward_s, "old_logps_s": logps_s, "update_s": update_s,
        "rollout_s": med("time/rollout"), "tokens_per_s": b * g * n / it,
        "iterations": len(steady),
        "compiles_first_iter": compiles_at[0] - 0 if compiles_at else 0,
        "recompiles_after_first": len(compiles) - compiles_at[0],
        "compiles_total": len(compiles),
        "old_logps_pass": old_logps_pass,
        "update_flops": 3 * fwd, "old_logps_flops": fwd if old_logps_pass else 0.0,
        "update_flops_per_s": 3 * fwd / update_s,
        "old_logps_flops_per_s": fwd / logps_s if logps_s > 0 else None,
        "params": mcfg.num_params(), "completion_length_mean": float(np.mean(lengths)),
        "reward_mean": float(np.mean([m["reward/mean"] for m in metrics_all])),
        "seq_len": seq, "token_efficiency": med("rollout/token_efficiency"),
        # Real / computed positions of the update's forward/backward (grouped: trimmed ones).
        "update_token_efficiency": (med("update/token_efficiency")
                                    if "update/token_efficiency" in metrics_all[-1] else None),
        "group_by_length": bool(cfg.algo.get("group_by_length", False)),
        "shared_prompt": bool(cfg.algo.get("shared_prompt", False)),
        "prompt_efficiency": med("rollout/prompt_efficiency"),
        "compilation_cache_dir": cfg.compilation_cache_dir, "compile_for": cfg.compile_for,
    }


# ----------------------------------------------------------------------------- orchestration

def run_json(cmd: list[str], timeout: float) -> dict:
    """Runs a runner, returns its last stdout line as JSON (or an error record)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    out = json.loads(lines[-1])
    out["process_wall_s"] = wall
    return out


def run_case(framework: str, spec: dict, pythons: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    try:
        if framework == "rljax":
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec_path]
        else:
            python = pythons[framework]
            if not os.path.exists(python):
                return {"error": f"no interpreter at {python} (install the peer's venv; see "
                                 f"bench/README.md)"}
            cmd = [python, os.path.join(ROOT, "bench", "peers", f"{framework}_grpo.py"), spec_path]
        return run_json(cmd, timeout)
    finally:
        os.unlink(spec_path)


def run_rljax_cold_warm(spec: dict, cache_dir: str, pythons: dict, timeout: float,
                        skip_warm: bool = False) -> dict:
    """The timed rljax run in a fresh process with an empty persistent compilation cache
    (``first_iter_s`` = cold), then a second process of the same config on that cache, one
    iteration (``first_iter_warm_s``: what a second ``rljax train`` of the config sees;
    ``skip_warm``: not run)."""
    res = run_case("rljax", dict(spec, compilation_cache_dir=cache_dir), pythons, timeout)
    if "error" not in res and not skip_warm:
        warm = run_case("rljax", dict(spec, compilation_cache_dir=cache_dir, iters=1), pythons,
                        timeout)
        res["first_iter_warm_s"] = warm.get("first_iter_s")
        res["compiles_first_iter_warm"] = warm.get("compiles_first_iter")
        res["setup_warm_s"] = warm.get("setup_s")
    return res


def make_spec(model_dir: str, b: int, g: int, n: int, iters: int, seed: int,
              device: str = "cpu", dtype: str = "float32") -> dict:
    return {"model_dir": model_dir, "prompts": bench_prompts(b), "num_generations": g,
            "max_new_tokens": n, "prompt_tokens": PROMPT_CHARS + 1, "iters": iters,
            "learning_rate": LEARNING_RATE, "seed": seed, "reward_char": REWARD_CHAR,
            "threads": os.cpu_count(), "device": device, "dtype": dtype}


def git_state() -> dict:
    """Commit and whether the rljax package differs from it (the numbers measure the tree)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "rljax_dirty": bool(git("status", "--porcelain", "--", "rljax"))}


def fmt(x, spec=".3f") -> str:
    return "—" if x is None else format(x, spec)


def comparison_table(rows: list[dict]) -> str:
    out = ["| shape | framework | s/iter (median) | tokens/s | rljax speed-up "
           "| first iter (s): cold / 2nd run | sample s | update s | load |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["result"]
        if "error" in res:
            out.append(f"| {r['shape']} | {r['framework']} | failed: {res['error'][:80]} "
                       "| | | | | | |")
            continue
        upd = res["update_s"] + res.get("old_logps_s", 0.0)
        out.append(f"| {r['shape']} | {r['framework']} | {res['iter_s']:.3f} "
                   f"| {res['tokens_per_s']:.0f} | {fmt(r.get('speedup'), '.2f')}x "
                   f"| {res['first_iter_s']:.1f} / {fmt(res.get('first_iter_warm_s'), '.1f')} "
                   f"| {res['sample_s']:.3f} | {upd:.3f} "
                   f"| {res.get('load_average_before', 0):.1f} |")
    return "\n".join(out)


def scaling_table(rows: list[dict]) -> str:
    out = ["| shape | G | N | s/iter | tokens/s | sample s | update s | first iter (s) "
           "| recompiles | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["result"]
        if "error" in res:
            out.append(f"| {r['shape']} | {r['g']} | {r['n']} | failed: {res['error'][:80]} "
                       "| | | | | | |")
            continue
        out.append(f"| {r['shape']} | {r['g']} | {r['n']} | {res['iter_s']:.3f} "
                   f"| {res['tokens_per_s']:.0f} | {res['sample_s']:.3f} "
                   f"| {res['update_s'] + res['old_logps_s']:.3f} | {res['first_iter_s']:.1f} "
                   f"| {res['recompiles_after_first']} | {res.get('load_average_before', 0):.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="base", help="comparison shapes: tiny,base,small")
    ap.add_argument("--prompts", type=int, default=8, help="B prompts per iteration")
    ap.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="N tokens per completion")
    ap.add_argument("--iters", type=int, default=6, help="timed iterations after the warm-up")
    ap.add_argument("--peers", default="trl,tunix", help="'none' or a subset of trl,tunix")
    ap.add_argument("--trl-python", default="/work/peers/trl/bin/python")
    ap.add_argument("--tunix-python", default="/work/peers/tunix/bin/python")
    ap.add_argument("--scaling", action=argparse.BooleanOptionalAction, default=True,
                    help="rljax scaling in G, N and model size")
    ap.add_argument("--scaling-g", default="4,8,16", help="G values (base shape, N fixed)")
    ap.add_argument("--scaling-n", default="32,64,128", help="N values (base shape, G fixed)")
    ap.add_argument("--scaling-shapes", default="tiny,base,small", help="shapes (G, N fixed)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                    help="where the peers run (TRL: use_cpu / CUDA); rljax takes JAX's default "
                         "backend, so on a GPU machine it runs there either way")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="parameter and compute dtype of every framework")
    ap.add_argument("--compile-for", default="throughput", choices=["throughput", "startup"],
                    help="rljax's compile_for (what XLA:CPU compiles the programs for)")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="a second rljax process on the first one's compilation cache")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "grpo_step.json"))
    args = ap.parse_args()

    if args.worker:
        with open(args.worker) as f:
            print(json.dumps(rljax_worker(json.load(f))))
        return

    import jax
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    pythons = {"trl": args.trl_python, "tunix": args.tunix_python}
    shapes = [s for s in args.shapes.split(",") if s]
    b, g, n = args.prompts, args.generations, args.new_tokens
    load_before = os.getloadavg()
    git_info = git_state()
    t_all = time.perf_counter()
    peak = measure_matmul_peak()
    print(f"float32 matmul peak (jitted 2048^3): {peak['flops_per_s'] / 1e9:.1f} GFLOP/s "
          f"(load average {load_before[0]:.2f})", flush=True)

    comparison, scaling = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dirs = {}

        def model_dir(shape):
            if shape not in model_dirs:
                model_dirs[shape] = os.path.join(tmp, shape)
                write_model(shape, model_dirs[shape], seed=args.seed)
            return model_dirs[shape]

        for shape in shapes:
            spec = make_spec(model_dir(shape), b, g, n, args.iters, args.seed, args.device,
                             args.dtype)
            spec["compile_for"] = args.compile_for
            for fw in ["rljax"] + peers:
                t0, load = time.perf_counter(), os.getloadavg()[0]
                if fw == "rljax":
                    res = run_rljax_cold_warm(spec, os.path.join(tmp, f"jax_cache_{shape}"),
                                              pythons, args.timeout, skip_warm=not args.warm)
                else:
                    res = run_case(fw, spec, pythons, args.timeout)
                res["load_average_before"] = load
                print(f"  {shape:6s} {fw:6s} "
                      + (f"{res['iter_s']:.3f} s/iter, first {res['first_iter_s']:.1f} s"
                         if "error" not in res else res["error"])
                      + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
                comparison.append({"shape": shape_label(shape), "framework": fw,
                                   "b": b, "g": g, "n": n, "result": res})
            base = next(r for r in comparison if r["shape"] == shape_label(shape)
                        and r["framework"] == "rljax")
            for r in comparison:
                if r["shape"] == shape_label(shape) and "error" not in r["result"] \
                        and "error" not in base["result"]:
                    r["speedup"] = r["result"]["iter_s"] / base["result"]["iter_s"]

        if args.scaling:
            ref = ("base", g, n)
            ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
            points = [("base", gg, n) for gg in ints(args.scaling_g)] + \
                     [("base", g, nn) for nn in ints(args.scaling_n)] + \
                     [(s, g, n) for s in args.scaling_shapes.split(",") if s]
            seen = []
            for p in points:
                if p in seen:
                    continue
                seen.append(p)
                shape, gg, nn = p
                done = next((r for r in comparison if r["framework"] == "rljax"
                             and r["shape"] == shape_label(shape) and (r["g"], r["n"]) == (gg, nn)),
                            None)
                if done is not None:
                    res = done["result"]
                else:
                    t0, load = time.perf_counter(), os.getloadavg()[0]
                    res = run_case("rljax", make_spec(model_dir(shape), b, gg, nn, args.iters,
                                                      args.seed), pythons, args.timeout)
                    res["load_average_before"] = load
                    print(f"  scaling {shape:6s} G={gg:<3d} N={nn:<4d} "
                          + (f"{res['iter_s']:.3f} s/iter" if "error" not in res
                             else res["error"]) + f"  [{time.perf_counter() - t0:.0f} s]",
                          flush=True)
                scaling.append({"shape": shape_label(shape), "g": gg, "n": nn, "result": res,
                                "reference": p == ref})

    load_after = os.getloadavg()
    runs = [dict(r, g=r.get("g", g), n=r.get("n", n)) for r in comparison + scaling
            if r.get("framework", "rljax") == "rljax" and "error" not in r["result"]]
    unique = {}
    for r in runs:
        unique.setdefault((r["shape"], r["g"], r["n"]), r["result"])
    mfu = [{"shape": k[0], "g": k[1], "n": k[2],
            "update_flops_per_s": res["update_flops_per_s"],
            "fraction_of_peak": res["update_flops_per_s"] / peak["flops_per_s"],
            "old_logps_fraction_of_peak": (res["old_logps_flops_per_s"] or 0)
            / peak["flops_per_s"]} for k, res in unique.items()]
    recompiles = {f"{k[0]} G={k[1]} N={k[2]}": res["recompiles_after_first"]
                  for k, res in unique.items()}
    results = {
        "benchmark": "grpo_step",
        "setup": {"prompts": b, "generations": g, "new_tokens": n, "dtype": args.dtype,
                  "compile_for": args.compile_for,
                  "peer_device": args.device, "device": jax.devices()[0].device_kind,
                  "prompt_tokens": PROMPT_CHARS + 1, "iters": args.iters,
                  "optimizer": f"adamw lr={LEARNING_RATE} wd=0 clip=1.0", "beta": 0.0,
                  "reward": f"fraction of {REWARD_CHAR!r}", "vocab": VOCAB},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "jax": jax.__version__,
                    "load_average_before": load_before, "load_average_after": load_after},
        "git": git_info,
        "matmul_peak": peak,
        "comparison": comparison,
        "scaling": scaling,
        "update_mfu": mfu,
        "recompiles_after_first": recompiles,
        "wall_s": time.perf_counter() - t_all,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

    print(f"\n## GRPO iteration: B={b} prompts x G={g} x N={n} new tokens, prompt 32 tokens, "
          f"{args.dtype}, {jax.devices()[0].device_kind} (peers on {args.device}; "
          f"{os.cpu_count()} cores, load {load_before[0]:.2f} -> {load_after[0]:.2f})\n")
    print(comparison_table(comparison))
    if scaling:
        print("\n## rljax scaling (G, N, model size)\n")
        print(scaling_table(scaling))
    print(f"\nfloat32 matmul peak: {peak['flops_per_s'] / 1e9:.1f} GFLOP/s")
    for m in mfu:
        print(f"update step ({m['shape']}, G={m['g']}, N={m['n']}): "
              f"{m['update_flops_per_s'] / 1e9:.1f} GFLOP/s = "
              f"{100 * m['fraction_of_peak']:.0f}% of peak"
              + (f" (old-logps pass {100 * m['old_logps_fraction_of_peak']:.0f}%)"
                 if m['old_logps_fraction_of_peak'] else " (no separate old-logps pass)"))
    print(f"XLA compilations after the first iteration, per rljax run: "
          f"{sorted(set(recompiles.values()))} (max {max(recompiles.values(), default=0)})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
