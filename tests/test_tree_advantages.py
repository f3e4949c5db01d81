"""Tree advantage estimators (treepo, rover) against written-out small trees."""
import numpy as np
import pytest

from rljax import algorithms
from rljax.sampling import tree as ts

# One root, two children, four leaves (tree_layout(1, 2, 2)):    0
#                                                              /   \
#                                                             1     2
#                                                            / \   / \
#                                                           3   4 5   6
BALANCED = np.array([[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]])
# Unbalanced (a path that forked less): root 0 -> nodes 1 (leaves 3, 4) and 2 (leaf 5).
UNBALANCED = np.array([[0, 1, 3], [0, 1, 4], [0, 2, 5]])


def test_registered_by_name():
    assert algorithms.get_advantage_estimator("treepo") is algorithms.treepo_advantages
    assert algorithms.get_advantage_estimator("rover") is algorithms.rover_advantages
    assert algorithms.uses_tree("treepo") and algorithms.uses_tree("rover")
    assert not algorithms.uses_tree("grpo")
    assert algorithms.is_token_level("rover") and not algorithms.is_token_level("treepo")


def test_treepo_written_out():
    r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    # Subgroups of each leaf: the group (mean 1/4) and its level-1 node (means 1/2, 1/2, 0, 0);
    # level 0 is the whole group again and level 2 the leaf alone: both left out.
    global_term = r - 0.25
    local_term = r - np.array([0.5, 0.5, 0.0, 0.0])
    a = (global_term + local_term) / 2                        # [.625, -.375, -.125, -.125]
    np.testing.assert_allclose(a, [0.625, -0.375, -0.125, -0.125])
    expected = a / (np.std(a, ddof=1) + 1e-6)
    out = algorithms.treepo_advantages(r, 4, node_ids=BALANCED)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    # Two groups at once; a constant group gets exactly 0.
    two = algorithms.treepo_advantages(np.concatenate([r, np.ones(4, np.float32)]), 4,
                                       node_ids=np.concatenate([BALANCED, BALANCED]))
    np.testing.assert_allclose(two[:4], expected, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(two[4:]) == 0.0)


def test_treepo_unbalanced_and_branching_one_is_grpo():
    r = np.array([1.0, 0.0, 1.0], np.float32)
    # Leaves 0, 1 share node 1 (mean 1/2); leaf 2 is alone under node 2 (no local term).
    a = np.array([((1 - 2 / 3) + (1 - 0.5)) / 2, ((0 - 2 / 3) + (0 - 0.5)) / 2, 1 - 2 / 3])
    out = algorithms.treepo_advantages(r, 3, node_ids=UNBALANCED)
    np.testing.assert_allclose(out, a / (np.std(a, ddof=1) + 1e-6), rtol=1e-6)
    # Every leaf its own root (no shared node): plain GRPO.
    flat, _ = ts.tree_layout(roots=4, branching=1, depth=2)
    r4 = np.array([0.0, 1.0, 0.5, 1.0], np.float32)
    np.testing.assert_allclose(algorithms.treepo_advantages(r4, 4, node_ids=flat),
                               algorithms.grpo_advantages(r4, 4), rtol=1e-6)


def test_tree_values_written_out():
    r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    v = np.asarray(algorithms.tree_values(r, 4, node_ids=BALANCED))
    # columns: root, level 0 (the single root path), level 1, level 2 (the leaf).
    np.testing.assert_allclose(v, [[0.25, 0.25, 0.5, 1.0], [0.25, 0.25, 0.5, 0.0],
                                   [0.25, 0.25, 0.0, 0.0], [0.25, 0.25, 0.0, 0.0]])
    # Unbalanced: node 1 = (1 + 0) / 2, node 2 = 1; the root is the mean of its two children
    # (0.75), not of its three leaves (2/3): the uniform-random policy picks a child, not a leaf.
    u = np.asarray(algorithms.tree_values(np.array([1.0, 0.0, 1.0], np.float32), 3,
                                          node_ids=UNBALANCED))
    np.testing.assert_allclose(u[:, 0], 0.75)
    np.testing.assert_allclose(u[:, 2], [0.5, 0.5, 1.0])


def test_rover_token_advantages_written_out():
    r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    segments = ts.segment_of_position(5, segment_tokens=1, depth=2)      # [0, 1, 2, 2, 2]
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)
    adv = np.asarray(algorithms.rover_advantages(r, 4, mask=mask, node_ids=BALANCED,
                                                 segments=segments))
    # Segment advantages V(node) - V(parent): level 0: 0.25 - 0.25; level 1: 0.5 - 0.25 or
    # 0 - 0.25; level 2: leaf - node.
    seg = np.array([[0.0, 0.25, 0.5], [0.0, 0.25, -0.5], [0.0, -0.25, 0.0], [0.0, -0.25, 0.0]])
    expected = np.where(mask, seg[:, segments], 0.0)
    np.testing.assert_allclose(adv, expected, atol=1e-7)
    # Over a leaf's segments they telescope to R - V(root).
    np.testing.assert_allclose(seg.sum(1), r - 0.25)
    const = algorithms.rover_advantages(np.ones(4, np.float32), 4, mask=mask,
                                        node_ids=BALANCED, segments=segments)
    assert np.all(np.asarray(const) == 0.0)
    with pytest.raises(ValueError, match="gamma"):
        algorithms.rover_advantages(r, 4, mask=mask, node_ids=BALANCED, segments=segments,
                                    gamma=0.9)


def test_node_ids_shape_is_checked():
    with pytest.raises(ValueError, match="node_ids must be"):
        algorithms.treepo_advantages(np.zeros(4, np.float32), 4, node_ids=BALANCED[:3])
