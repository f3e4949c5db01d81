"""Run by ``test_multihost.py``, as 1 process of 4 CPU devices and as each of 2 local processes
of 2: GRPO on the slot engine (``BASE/slots``), on guess-the-number games (``BASE/episodes``,
the episode engine), on games carried across iterations by asynchronous GRPO
(``BASE/episodes_partial``: a device of each process samples), on trees of forks served as
engine requests (``BASE/tree``) and carried across iterations (``BASE/tree_partial``), on
TicTacToe self-play in static turn batches (``BASE/selfplay``) and carried across iterations
on the engine (``BASE/selfplay_partial``), with in-flight weight updates (``BASE/inflight``,
``staggered_updates``), then with partial rollouts
checkpointed every step (``BASE/partial``). With ``resume`` the partial run then drops its
last checkpoint, keeps its metrics as ``BASE/first.jsonl`` and resumes, redoing the last step.
All in one launch, so each process starts and compiles the update once.

    python tests/engine_worker.py BASE resume|straight CONFIG OVERRIDES...
"""
import json
import os
import shutil
import sys

from rljax import cli, distributed

PARTIAL = ["--config.rollout.partial=true", "--config.checkpoint_every=1"]
# Games of up to 3 guesses of 4 tokens (an untrained model rarely solves one: the length
# reward varies within a group).
EPISODES = ["--config.data.source=guess_number", "--config.data.max_prompt_length=32",
            "--config.data.kwargs={'low':1,'high':100,'eval_examples':8}",
            "--config.env.name=guess_number", "--config.env.max_turns=3",
            "--config.env.max_total_tokens=24", "--config.env.max_turn_tokens=4",
            "--config.env.max_obs_tokens=8", "--config.reward.names=('length',)"]
# One step of TicTacToe self-play, one policy in both seats: 2 moves each (a cell, a stop).
SELFPLAY = ["--config.data.source=tictactoe", "--config.data.template=plain",
            "--config.data.max_prompt_length=32",
            "--config.data.kwargs={'seat':'any','eval_examples':8}",
            "--config.env.name=tictactoe", "--config.env.max_turns=2",
            "--config.env.max_total_tokens=24", "--config.env.max_turn_tokens=2",
            "--config.env.max_obs_tokens=12", "--config.env.selfplay.mode=self",
            "--config.env.kwargs={'opponent':'random','illegal_penalty':-1.0}",
            "--config.reward.names=()", "--config.reward.kwargs={}",
            "--config.rollout.max_new_tokens=2", "--config.steps=1"]
# One step on trees of 4 leaves forked after the first token (two levels: the fewest programs).
TREE = ["--config.steps=1", "--config.rollout.tree.enabled=true",
        "--config.rollout.tree.segment_tokens=1", "--config.rollout.tree.branching=4"]
ASYNC = ["--config.algo.asynchronous=true", "--config.mesh.rollout_devices=2",
         "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.rollout.data=1",
         "--config.mesh.rollout.fsdp=2"]
# In-flight weight updates under asynchronous GRPO, a decode chunk a token: update 0 reaches
# the sampler while it draws batch 1 (games: the update as compiled for episodes_partial).
INFLIGHT = EPISODES + ASYNC + ["--config.algo.inflight_updates=true",
                               "--config.rollout.chunk_steps=1"]


def staggered_updates(workdir: str):
    """Makes in-flight updates deterministic and records the swaps: process p sees an update
    finish at the sampler's poll 3 - p (one process: 3), so the processes disagree, and only
    agreeing on the later poll makes the run equal one process's. Every in-flight publish
    appends (version, poll) to ``workdir/swaps_<process>.json``."""
    from rljax.train.phases import async_grpo

    seen, swaps = {"poll": 0}, []

    def done(watch):
        watch.polls = seen["poll"] = getattr(watch, "polls", 0) + 1
        if watch.polls < 3 - distributed.process_index():
            return False
        watch._thread.join()   # (the update has finished)
        return True

    publish = async_grpo.AsyncSchedule.publish

    def recorded(self, state, version):
        if seen["poll"]:   # (a publish between iterations polls nothing)
            swaps.append((int(version), seen["poll"]))
            seen["poll"] = 0
            with open(os.path.join(workdir, f"swaps_{distributed.process_index()}.json"), "w") as f:
                json.dump(swaps, f)
        return publish(self, state, version)

    async_grpo._Watch.done, async_grpo.AsyncSchedule.publish = done, recorded


def main(base: str, resume: bool, config: str, *overrides: str) -> int:
    distributed.initialize()
    train = ["train", "--config", config, *overrides]
    for name, extra in (("slots", []), ("episodes", EPISODES),
                        ("episodes_partial", EPISODES + PARTIAL + ASYNC), ("tree", TREE),
                        ("tree_partial", TREE + PARTIAL),
                        ("selfplay", SELFPLAY + ["--config.rollout.engine=static"]),
                        ("selfplay_partial", SELFPLAY + PARTIAL), ("inflight", INFLIGHT),
                        ("partial", PARTIAL)):
        if name == "inflight":
            os.makedirs(os.path.join(base, name), exist_ok=True)
            staggered_updates(os.path.join(base, name))
        code = cli.main([*train, *extra, "--workdir", os.path.join(base, name)])
        if code or not resume and name == "partial":
            return code
    workdir = os.path.join(base, "partial")
    if distributed.is_main():
        shutil.copy(os.path.join(workdir, "metrics.jsonl"), os.path.join(base, "first.jsonl"))
        shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))   # as if killed before it
    distributed.barrier("dropped the last checkpoint")
    return cli.main([*train, *PARTIAL, "--workdir", workdir])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] == "resume", *sys.argv[3:]))
