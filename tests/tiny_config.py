"""The smallest config a CLI test trains with, written out as a config file.

``tiny_config_source(**changes)`` returns the text of a config file whose ``get_config()``
is the tiny run below with ``changes`` laid over it (a dict value updates that section; any
other value replaces the key), so each test states only how its run differs.
"""
import copy

TINY = dict(
    steps=2,
    checkpoint_every=0,
    model=dict(preset="tiny", overrides=dict(num_layers=1, hidden_size=32,
                                             intermediate_size=64, num_heads=2,
                                             num_kv_heads=1)),
    tokenizer=dict(kind="char"),
    data=dict(source="arithmetic", max_prompt_length=8,
              kwargs=dict(digits=1, eval_examples=8)),
    rollout=dict(batch_size=8, max_new_tokens=4),
    algo=dict(num_generations=4, beta=0.0),
    optimizer=dict(learning_rate=1e-3),
    eval=dict(num_examples=8, batch_size=8),
    memory=dict(check="off"),
    logging=dict(tensorboard=False, console_every_s=0.0),
)


def tiny_config_source(**changes) -> str:
    """Config-file text for TINY updated with ``changes`` (sections merged one level deep)."""
    cfg = copy.deepcopy(TINY)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    lines = ["import ml_collections", "", "", "def get_config():",
             "    c = ml_collections.ConfigDict()"]
    lines += [f"    c.{key} = {value!r}" for key, value in cfg.items()]
    lines += ["    return c", ""]
    return "\n".join(lines)
