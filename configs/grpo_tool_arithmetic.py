"""Agents demo: a tiny llama from scratch learns to use a calculator tool for 3-digit
multiplication (which it cannot do in its head), over multi-turn episodes on a CPU.

A short SFT warm-up on scripted tool-use episodes (``sft.env_traces``: the prompt, the call
``<call calculator>123*456</call>``, the result ``<result>56088</result>`` as context, the
answer) teaches the format; GRPO then trains on the model's own episodes, the loss on its own
tokens only. ``configs/grpo_tool_arithmetic_notool.py`` is the same model and budget without
the tool. Numbers: bench/RESULTS.md.

    rljax train --config configs/grpo_tool_arithmetic.py --workdir runs/tools
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 120                      # GRPO iterations
    c.eval_every = 100
    c.checkpoint_every = 100
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=80))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=3, operands=2, ops="*", eval_examples=500))
    c.env = dict(name="tool", tools=("calculator",), tool_format="plain", max_turns=3,
                 max_total_tokens=64, max_turn_tokens=32, max_obs_tokens=23,
                 kwargs=dict(describe_tools=False))   # a tiny model learns the format by SFT
    c.rollout = dict(batch_size=256, max_new_tokens=32, temperature=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo")
    # A gentle start: the first Adam step moves every weight by ~lr whatever its gradient
    # (3e-4 with no warm-up broke the warm-up's call format in one step).
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=10, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))   # on the final model turn's text
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=72, env_traces=True)
    c.eval = dict(num_examples=500, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
