"""Hostile or broken files are one line, never a RecursionError or a huge allocation: a GGUF
header nesting arrays 200,000 deep, a chat template that renders 100 MB, a deeply nested
config.json."""
import struct

import pytest

from rljax import models
from rljax.errors import UserError


def _nested_gguf(path, depth):
    """A GGUF v3 header with one metadata key: an array of an array of ... (``depth``)."""
    key = b"evil.nested"
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    out += struct.pack("<I", 9)                         # ARRAY
    out += struct.pack("<IQ", 9, 1) * depth             # of ARRAY, count 1, ...
    out += struct.pack("<IQ", 0, 0)                     # ... of no UINT8
    path.write_bytes(out)
    return str(path)


def test_a_gguf_header_nesting_arrays_200k_deep_is_one_line(tmp_path):
    from rljax.models.gguf_file import GGUFFile, GGUFFormatError
    path = _nested_gguf(tmp_path / "evil.gguf", 200_000)
    with pytest.raises(GGUFFormatError, match="nest more than 32 deep"):
        GGUFFile(path)
    with pytest.raises(UserError) as err:   # what `rljax train` reports
        models.inspect_gguf(path)
    assert "\n" not in str(err.value) and "nest" in str(err.value)


def test_shallow_nesting_still_reads(tmp_path):
    from rljax.models.gguf_file import GGUFFile
    reader = GGUFFile(_nested_gguf(tmp_path / "ok.gguf", 3))
    assert reader.value("evil.nested") == [[[[]]]]   # 3 arrays of arrays, then an empty one


def test_a_config_json_nesting_100k_deep_is_one_line(tmp_path, capsys):
    from rljax import cli
    from rljax import config as config_lib
    from rljax.errors import ConfigError
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    path = tmp_path / "config.json"
    path.write_text(deep)
    with pytest.raises(ConfigError, match="nests too deeply"):
        config_lib.load_config_json(str(path))
    with pytest.raises(ConfigError, match="nests too deeply"):
        config_lib.config_from_file(str(path))
    assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2   # a workdir's config.json
    err = capsys.readouterr().err.strip()
    assert err.startswith("rljax: error:") and "nests too deeply" in err and "\n" not in err


def test_check_prompt_lengths_names_the_prompt_and_the_rule():
    from rljax.train.run import check_prompt_lengths
    check_prompt_lengths([10, 448], 64, 512)   # exactly fits
    with pytest.raises(UserError, match=r"prompt 2 is 449 tokens; with 64 new tokens it needs "
                                        r"513 positions, more than the model's context "
                                        r"\(max_position_embeddings=512\)"):
        check_prompt_lengths([10, 449], 64, 512)


def test_sample_raw_with_a_prompt_beyond_the_context_is_one_line(tmp_path, capsys):
    import jax

    from rljax import cli
    from rljax import config as config_lib
    from rljax.train import run
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 1, "eval_every": 0, "model.preset": "tiny", "tokenizer.kind": "char",
        "data.source": "arithmetic", "data.max_prompt_length": 8, "rollout.batch_size": 8,
        "rollout.max_new_tokens": 4, "algo.num_generations": 4, "algo.beta": 0.0,
        "eval.num_examples": 8, "eval.batch_size": 8, "logging.tensorboard": False,
        "checkpoint.async_save": False, "memory.check": "off"})
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    workdir = str(tmp_path / "run")
    assert run.train(config_lib.validate(cfg), workdir, devices=jax.devices()[:1]) == 0
    capsys.readouterr()
    assert cli.main(["sample", "--workdir", workdir, "--raw", "--prompt", "1+" * 300]) == 2
    captured = capsys.readouterr()
    assert "--- completion" not in captured.out
    err = captured.err.strip()
    assert err.startswith("rljax: error: prompt 1 is 600 tokens") and "\n" not in err


# ---- chat templates are code: bounded output ---------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_tokenizer(tmp_path, template):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rljax import tokenizers
    raw = Tokenizer(tm.WordLevel({"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    return tokenizers.HFTokenizer(str(tmp_path / "tok"))


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**8 }}",                                      # one huge repetition
    "{{ 7 ** 100000000 }}",                                   # a number of 85M digits
    "{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}",   # 1e8 in pieces
])
def test_a_chat_template_that_renders_hundreds_of_megabytes_is_one_line(tmp_path, template):
    import time

    from rljax.chat_limits import TemplateTooLarge
    tok = _hf_tokenizer(tmp_path, template)
    start = time.monotonic()
    with pytest.raises(TemplateTooLarge) as err:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 30
    assert "\n" not in str(err.value) and "chat template" in str(err.value)


@pytest.mark.parametrize("template", [
    "{{ 'a'|center(100000000) }}",                             # a filter's width
    "{{ '%100000000s'|format('a') }}",                         # a printf width
    "{{ '%100000000s' % 'a' }}",
    "{{ 'a'.center(100000000) }}",                             # a string method's width
    "{{ '{:>100000000}'.format('a') }}",
    "{{ (['a' * 1000000] * 5)|join('x') }}",                   # a join of allowed pieces
    "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",                           # doubled 27 times: 268M
    "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
    "{% endmacro %}{{ f('ab', 27) }}",                         # the same by recursion
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
])
def test_a_chat_template_is_refused_before_it_builds_a_huge_string_or_runs_forever(
        template, monkeypatch):
    """Each of these was refused only after building 100-400 MB, passed with a 134M-char
    value, or never finished; now one line, at most a few times the limit allocated."""
    import tracemalloc

    from rljax import chat_limits
    monkeypatch.setattr(chat_limits, "MAX_RENDER_SECONDS", 0.5, raising=False)
    tracemalloc.start()
    try:
        with pytest.raises(chat_limits.TemplateTooLarge) as err:
            chat_limits.check_chat_template(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value) and "chat template" in str(err.value)
    assert peak < 12 * chat_limits.MAX_OUTPUT_CHARS, peak
    chat_limits.check_chat_template(CHATML)   # an ordinary template still passes


def test_an_ordinary_chat_template_renders_as_transformers_renders_it(tmp_path):
    tok = _hf_tokenizer(tmp_path, CHATML)
    messages = [{"role": "user", "content": "a a"}]
    assert tok.apply_chat_template(messages) == tok.hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_a_long_render_is_refused_before_it_is_tokenized():
    from rljax.chat_limits import MAX_OUTPUT_CHARS, TemplateTooLarge, check_rendered
    assert check_rendered("ok") == "ok"
    with pytest.raises(TemplateTooLarge, match="rendered"):
        check_rendered("a" * (MAX_OUTPUT_CHARS + 1))
