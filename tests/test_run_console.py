"""What a user sees on the console of a finished run: the warm-up's eval accuracy (not only the
final one), an end-of-run summary saying where results, curves and checkpoints are, and a clear
list when `eval --checkpoint N` names a step that was not kept."""
import re

from rljax import cli

from tiny_config import tiny_config_source

TINY = tiny_config_source(
    steps=1, sft=dict(steps=1, batch_size=8, max_length=16, learning_rate=1e-3),
    checkpoint=dict(async_save=False), logging=dict(console_every_s=3600.0))


def test_warmup_accuracy_summary_and_missing_checkpoint_list(tmp_path, capsys):
    config = tmp_path / "tiny.py"
    config.write_text(TINY)
    workdir = str(tmp_path / "w")
    assert cli.main(["train", "--config", str(config), "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    # The warm-up's eval (step 1) is on the console although console_every_s is an hour.
    assert re.search(r"^eval at step 1 \| eval/accuracy ", out, re.M), out
    assert re.search(r"^eval at step 2 \| eval/accuracy ", out, re.M), out
    summary = out[out.index("rljax: done."):]
    assert re.search(r"eval/accuracy: \S+ \(step 1, end of the SFT warm-up\) -> \S+ "
                     r"\(step 2, end of grpo\)", summary), summary
    assert f"{workdir}/metrics.jsonl" in summary and f"rljax plot {workdir}" in summary
    assert "steps 1, 2; the last 3 are kept" in summary
    assert "rljax eval --workdir" in summary and "rljax export" in summary

    assert cli.main(["eval", "--workdir", workdir, "--checkpoint", "400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint '400' not found; saved steps: [1, 2]" in err[0], err
