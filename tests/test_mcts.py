"""MCTS over steps (rljax.algorithms.mcts) against a hand-worked search on a fixed tree."""
import math

import numpy as np
import pytest

from rljax.algorithms import mcts

# A root whose three next steps have priors 0.5, 0.3, 0.2 and end the trace with values
# 0.2, 0.9, 0.5; the root itself evaluates to 0.
PRIORS = {"a": 0.5, "b": 0.3, "c": 0.2}
VALUES = {(): 0.0, ("a",): 0.2, ("b",): 0.9, ("c",): 0.5}


def expand_fn(node):
    assert node.steps == ()   # only the root is ever expanded: its children are terminal
    return [(step, p, True) for step, p in PRIORS.items()]


def evaluate_fn(node):
    return VALUES[node.steps]


def test_puct_selection_and_backup_follow_the_hand_worked_search():
    """c_puct = 1, an unvisited child's Q = 0. Worked by hand, score = Q + P sqrt(N) / (1 + n):
    sim 1 expands and evaluates the root (0); sim 2 (N=1): a 0.5, b 0.3, c 0.2 -> a (0.2);
    sim 3 (N=2): a 0.2 + 0.5*1.414/2 = 0.554, b 0.424, c 0.283 -> a; sim 4 (N=3): a 0.489,
    b 0.520, c 0.346 -> b (0.9); sim 5 (N=4): a 0.533, b 1.2, c 0.4 -> b; sim 6 (N=5): a 0.573,
    b 1.124, c 0.447 -> b."""
    root = mcts.Node()
    picked = []
    for _ in range(6):
        path = mcts.simulate(root, expand_fn, evaluate_fn, c_puct=1.0)
        picked.append(path[-1].steps)
    assert picked == [(), ("a",), ("a",), ("b",), ("b",), ("b",)]
    a, b, c = root.children
    assert [root.visits, a.visits, b.visits, c.visits] == [6, 2, 3, 0]
    assert root.value_sum == pytest.approx(0.0 + 0.2 + 0.2 + 3 * 0.9)
    assert (a.value, b.value, c.value) == (pytest.approx(0.2), pytest.approx(0.9), 0.0)
    scores = mcts.puct_scores(root, 1.0)    # the next selection, written out
    n = math.sqrt(6)
    np.testing.assert_allclose(scores, [0.2 + 0.5 * n / 3, 0.9 + 0.3 * n / 4, 0.2 * n / 1])
    assert mcts.best_trace(root) == ("b",)


def test_ties_go_to_the_first_child_and_priors_are_normalised():
    root = mcts.Node()
    mcts.expand(root, [("x", 2.0, False), ("y", 2.0, False), ("x", 9.0, False)])
    assert [c.steps for c in root.children] == [("x",), ("y",)]   # a repeated step is one child
    assert [c.prior for c in root.children] == [0.5, 0.5]
    root.visits = 4
    assert mcts.select_child(root, 1.0) is root.children[0]          # equal scores: the first
    zero = mcts.Node()
    mcts.expand(zero, [("x", 0.0, False), ("y", 0.0, False)])
    assert [c.prior for c in zero.children] == [0.5, 0.5]            # no mass: uniform


def test_a_search_is_a_function_of_its_seed():
    def run(seed):
        rng = np.random.default_rng(seed)

        def expand_random(node):
            k = 3 if len(node.steps) < 3 else 0
            return [((len(node.steps), i), float(rng.random()), len(node.steps) == 2)
                    for i in range(k)]

        def evaluate_random(node):
            return float(rng.random())
        root = mcts.search(mcts.Node(), expand_random, evaluate_random, budget=40, c_puct=1.5)
        flat, stack = [], [root]
        while stack:
            node = stack.pop()
            flat.append((node.steps, node.visits, round(node.value_sum, 12)))
            stack.extend(node.children)
        return flat
    assert run(3) == run(3)
    assert run(3) != run(4)
