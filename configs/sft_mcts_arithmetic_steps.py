"""ReST-MCTS*-style self-training on multi-step arithmetic (tiny llama, CPU): MCTS over steps
finds solutions, the policy trains on the best verified one per prompt.

The warm-up is ``configs/grpo_arithmetic_steps.py``'s (200 SFT steps on the task's
left-to-right solutions, one line per operation: "3+4=7\\n7-2=5"). Then each step is a round:
for each of ``sft.batch_size`` prompts, a search (``algo.mcts``: ``simulations`` rounds of
PUCT selection, expansion by ``children`` sampled next steps, evaluation by ``rollouts``
continuations to the end, backup), all prompts' leaves sampled in one batched call per wave;
the best verified trace of each prompt (the most visited terminal node whose reward reaches
``algo.mcts.correct_reward``) is an SFT row, prompts without one train nothing. Logs
``mcts/solved_frac``, ``mcts/nodes_mean``, ``mcts/depth_mean``, ``mcts/value_root_mean``
(docs/tree_search.md). With a PRM run (``configs/prm_arithmetic_steps.py``) as the leaf value:
``--config.algo.mcts.value=prm --config.algo.mcts.prm=runs/prm``.

    rljax train --config configs/sft_mcts_arithmetic_steps.py --workdir runs/rest_mcts
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 40                       # search-and-train rounds (after the warm-up)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 20
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  step_delimiter="\n",
                  kwargs=dict(digits=1, operands=3, ops="+-", steps=True, eval_examples=500))
    c.rollout = dict(batch_size=64, max_new_tokens=16, temperature=1.0)
    c.algo = dict(name="sft", mcts=dict(simulations=8, children=4, rollouts=4, max_nodes=64,
                                        c_puct=1.0, value="mc", correct_reward=1.0))
    c.optimizer = dict(learning_rate=1e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    # The warm-up and the rounds share sft.batch_size (prompts searched per round) and
    # sft.max_length, so they run the same compiled update.
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=26, traces="mcts")
    c.eval = dict(num_examples=500, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
