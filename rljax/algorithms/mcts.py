"""Monte-Carlo tree search over reasoning steps: PUCT selection, expansion, evaluation, backup.

A node is a prefix of steps; its children are the next steps sampled from it. One simulation:

1. **select**: from the root, follow the child of highest PUCT score until a node that is not
   expanded (or terminal):
       score(child) = Q(child) + c_puct * P(child) * sqrt(N(node)) / (1 + N(child))
   with Q the mean backed-up value (``unvisited_value`` for a child never visited), P its prior
   (the policy's probability of the step, normalised over the siblings) and N visit counts.
   Ties go to the first child in expansion order, so a search is a pure function of its inputs.
2. **expand**: ``expand(node) -> [(step, prior, terminal)]`` proposes the children (the
   rollout samples K next steps with the policy).
3. **evaluate**: ``evaluate(node) -> value`` (a process reward model, Monte-Carlo rollouts, or
   the verifier at a terminal node).
4. **backup**: every node on the path gets one more visit and the value added to its sum.

Values are the one agent's (a reasoning trace has no opponent), so no sign flips. ``search``
runs ``budget`` simulations; the host-side tree is plain Python, the model calls are the
caller's (batched by the rollout). Used to find traces and per-step values for training
(ReST-MCTS*-style self-training, process advantages, step-level preference pairs).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable, Sequence


@dataclasses.dataclass
class Node:
    """One prefix of steps. ``steps``: the steps from the root; ``prior``: P given the parent."""
    steps: tuple = ()
    prior: float = 1.0
    terminal: bool = False
    visits: int = 0
    value_sum: float = 0.0
    children: list["Node"] = dataclasses.field(default_factory=list)
    expanded: bool = False

    @property
    def value(self) -> float:
        """Q: the mean backed-up value (0 before any visit)."""
        return self.value_sum / self.visits if self.visits else 0.0


def puct_scores(node: Node, c_puct: float, unvisited_value: float = 0.0) -> list[float]:
    """The PUCT score of each child of ``node`` (in expansion order)."""
    total = math.sqrt(node.visits)
    return [(child.value if child.visits else unvisited_value)
            + c_puct * child.prior * total / (1 + child.visits) for child in node.children]


def select_child(node: Node, c_puct: float, unvisited_value: float = 0.0) -> Node:
    """The child of highest PUCT score; the first one on ties."""
    scores = puct_scores(node, c_puct, unvisited_value)
    return node.children[max(range(len(scores)), key=lambda i: (scores[i], -i))]


def backup(path: Sequence[Node], value: float) -> None:
    """One visit and ``value`` for every node on ``path`` (root first)."""
    backup_values(path, [value] * len(path))


def backup_values(path: Sequence[Node], values: Sequence[float]) -> None:
    """One visit for every node on ``path`` (root first), ``values[i]`` added to ``path[i]``'s
    sum: a value of its own per node, e.g. returns discounted from each node's depth."""
    for node, value in zip(path, values, strict=True):
        node.visits += 1
        node.value_sum += float(value)


def expand(node: Node, proposals: Sequence[tuple[Hashable, float, bool]]) -> None:
    """Adds ``(step, prior, terminal)`` children; priors are normalised over the siblings
    (equal when they sum to 0). A step proposed twice is one child (the first prior kept)."""
    seen, kept = set(), []
    for step, prior, terminal in proposals:
        if step not in seen:
            seen.add(step)
            kept.append((step, max(float(prior), 0.0), bool(terminal)))
    total = sum(p for _, p, _ in kept)
    node.children = [Node(steps=node.steps + (step,),
                          prior=(p / total) if total > 0 else 1.0 / len(kept), terminal=t)
                     for step, p, t in kept]
    node.expanded = True


def simulate(root: Node, expand_fn: Callable[[Node], Any],
             evaluate_fn: Callable[[Node], float], c_puct: float = 1.0,
             unvisited_value: float = 0.0) -> list[Node]:
    """One select -> expand -> evaluate -> backup; returns the path it backed up."""
    path, node = [root], root
    while node.expanded and node.children and not node.terminal:
        node = select_child(node, c_puct, unvisited_value)
        path.append(node)
    if not node.terminal and not node.expanded:
        expand(node, expand_fn(node))
    backup(path, evaluate_fn(node))
    return path


def search(root: Node, expand_fn: Callable[[Node], Any], evaluate_fn: Callable[[Node], float],
           budget: int, c_puct: float = 1.0, unvisited_value: float = 0.0) -> Node:
    """``budget`` simulations from ``root`` (modified in place, also returned)."""
    for _ in range(int(budget)):
        simulate(root, expand_fn, evaluate_fn, c_puct, unvisited_value)
    return root


def best_trace(root: Node) -> tuple:
    """The steps of the most visited path from the root (ties: the higher value, then the
    first), down to a leaf."""
    node = root
    while node.children:
        node = max(node.children, key=lambda c: (c.visits, c.value))
    return node.steps
