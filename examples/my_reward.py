"""A reward function of your own, used by path: ``reward.names=("examples/my_reward.py:close_enough",)``.

Every reward function has the same shape::

    fn(prompts: list[str], completions: list[str], **fields) -> list[float]   # one score each

``fields`` are the dataset's other columns, one value per completion (here ``answer``), plus
``completion_lengths`` (tokens). Name only the ones you need: a function without ``**kwargs``
gets just the fields it names.
"""
import re


def close_enough(prompts, completions, answer):
    """1 for the right number, 0.5 for one that is off by one, else 0."""
    scores = []
    for completion, reference in zip(completions, answer):
        match = re.search(r"-?\d+", completion)
        if match is None:
            scores.append(0.0)
            continue
        miss = abs(int(match.group()) - int(reference))
        scores.append(1.0 if miss == 0 else 0.5 if miss == 1 else 0.0)
    return scores


def make_length_bonus(per_char=0.01, limit=8):
    """A factory: called once with ``reward.kwargs["make_length_bonus"]``, returns the function."""
    def length_bonus(prompts, completions, **_):
        return [per_char * min(len(c), limit) for c in completions]
    return length_bonus
