"""What a user sees on the console of a finished run: the warm-up's eval accuracy (not only the
final one), an end-of-run summary saying where results, curves and checkpoints are, and a clear
list when `eval --checkpoint N` names a step that was not kept (issue 20 item 6)."""
import re

from rljax import cli

TINY = """
import ml_collections

def get_config():
    c = ml_collections.ConfigDict()
    c.steps = 1
    c.checkpoint_every = 0
    c.model = dict(preset="tiny", overrides=dict(num_layers=1, hidden_size=32,
                   intermediate_size=64, num_heads=2, num_kv_heads=1))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", max_prompt_length=8,
                  kwargs=dict(digits=1, eval_examples=8))
    c.rollout = dict(batch_size=8, max_new_tokens=4)
    c.algo = dict(num_generations=4, beta=0.0)
    c.sft = dict(steps=1, batch_size=8, max_length=16, learning_rate=1e-3)
    c.optimizer = dict(learning_rate=1e-3)
    c.eval = dict(num_examples=8, batch_size=8)
    c.memory = dict(check="off")
    c.checkpoint = dict(async_save=False)
    c.logging = dict(tensorboard=False, console_every_s=3600.0)
    return c
"""


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
    assert re.search(r"eval/accuracy: \S+ \(step 1\) -> \S+ \(step 2\)", summary), summary
    assert f"{workdir}/metrics.jsonl" in summary and f"rljax plot {workdir}" in summary
    assert "steps 1, 2; the last 3 are kept" in summary
    assert "rljax eval --workdir" in summary and "rljax export" in summary

    assert cli.main(["eval", "--workdir", workdir, "--checkpoint", "400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint '400' not found; saved steps: [1, 2]" in err[0], err
