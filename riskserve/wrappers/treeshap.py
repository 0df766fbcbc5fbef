"""Exact TreeSHAP of an XGBoost model in tens of microseconds a row: per-leaf tables, a small C kernel.

XGBoost's ``pred_contribs`` (path-dependent TreeSHAP) costs about a millisecond a row on the demo's 200
trees, most of it re-deriving, for every row, quantities that depend only on the model. For one leaf whose
path splits on ``k`` distinct features with cover fractions ``z``, the row enters only through which of
those features it *follows* (every split on that feature goes the path's way): ``2**k`` cases. Each case's
Shapley values are tabulated here once per model version (``k`` is at most the tree depth), and the kernel
(``_treeshap.c``) sums, per row, each leaf's entry for the row's case. The sum is the same Shapley value
XGBoost computes; :func:`build_tree_shap` only builds it, and the loader serves it after it reproduced
XGBoost's own contributions on the gate rows (``treelite_compile``), else keeps XGBoost.

A leaf's value ``v`` and cover fractions give, for a coalition ``S`` of the path's features, the expected
leaf output ``v * prod(o_j, j in S) * prod(z_j, j not in S)`` (``o_j`` 1 when the row follows ``j``); the
Shapley value of feature ``i`` is then ``v * (o_i - z_i) * sum_S w(|S|) prod(o_j, S) prod(z_j, rest)``
over ``S`` not holding ``i``, whose inner sum is read off the polynomial ``prod_{j != i} (z_j + o_j t)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["MAX_PATH_FEATURES", "MAX_TABLE_VALUES", "TreeShap", "UnsupportedModel", "build_tree_shap"]

MAX_PATH_FEATURES = 16
"""Distinct features on one leaf's path beyond which the model is explained by XGBoost instead: a leaf's
table holds ``2**k * k`` values."""
MAX_TABLE_VALUES = 16_000_000
"""Values (float64) of all tables together beyond which XGBoost explains instead: 128 MB in every replica
that serves the model is the most this shortcut may cost."""

_OBJECTIVES = frozenset({"binary:logistic", "reg:logistic"})


class UnsupportedModel(ValueError):
    """The model has a feature this explainer does not reproduce (XGBoost then explains it)."""


try:  # built by `pip install -e .` (setuptools ext-modules); without it XGBoost explains
    from riskserve.wrappers import _treeshap  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by the fallback test through the loader
    _treeshap = None


def kernel_available() -> bool:
    """Whether the compiled kernel was built with the package."""
    return _treeshap is not None


@dataclass(frozen=True, eq=False)
class TreeShap:
    """The tables and flattened paths of one model version; :meth:`contributions` is thread safe."""

    n_features: int
    bias: float
    """Base margin plus every tree's cover-weighted mean: XGBoost's last ``pred_contribs`` column."""
    node_feature: NDArray[np.int32]
    node_threshold: NDArray[np.float32]
    node_default_left: NDArray[np.uint8]
    path_start: NDArray[np.int64]
    path_node: NDArray[np.int32]
    path_left: NDArray[np.uint8]
    path_slot: NDArray[np.uint8]
    slot_start: NDArray[np.int64]
    slot_feature: NDArray[np.int32]
    table_start: NDArray[np.int64]
    table: NDArray[np.float64]

    @property
    def table_bytes(self) -> int:
        """Memory the tables and paths take."""
        arrays = (self.table, self.path_node, self.path_left, self.path_slot, self.slot_feature)
        return int(sum(a.nbytes for a in arrays))

    def contributions(self, rows: NDArray[Any]) -> NDArray[np.float64]:
        """Per-feature TreeSHAP values (rows × features, log-odds) of a 2-D batch; NaN means missing.

        Raises:
            RuntimeError: the compiled kernel is not built (check :func:`kernel_available` first).
            ValueError: ``rows`` is not 2-D with ``n_features`` columns.
        """
        if _treeshap is None:
            raise RuntimeError("riskserve.wrappers._treeshap is not built")
        x = np.ascontiguousarray(rows, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"rows of shape {x.shape}, expected (n, {self.n_features})")
        out = np.empty((x.shape[0], self.n_features), dtype=np.float64)
        _treeshap.contributions(
            x.shape[0], self.n_features, self.node_feature.size, self.table_start.size,
            self.path_node.size, self.slot_feature.size, self.table.size, x, self.node_feature,
            self.node_threshold, self.node_default_left, self.path_start, self.path_node, self.path_left,
            self.path_slot, self.slot_start, self.slot_feature, self.table_start, self.table, out,
        )  # fmt: skip
        return out


@dataclass
class _Leaf:
    value: float
    path: list[tuple[int, bool, int]]
    """(global split index, whether the path goes left, feature) from the root down."""
    features: list[int]
    zero_fractions: list[float]


def build_tree_shap(model: Mapping[str, Any]) -> TreeShap:
    """Tables for the XGBoost model ``model`` (its JSON document, as ``Booster.save_raw("json")`` gives it).

    Raises:
        UnsupportedModel: not a single-output gbtree of numeric splits with a logistic objective, a cover
            of zero, or tables past :data:`MAX_PATH_FEATURES` / :data:`MAX_TABLE_VALUES`.
    """
    try:
        learner = model["learner"]
        objective = str(learner["objective"]["name"])
        if objective not in _OBJECTIVES:
            raise UnsupportedModel(f"objective '{objective}'")
        n_features = int(learner["learner_model_param"]["num_feature"])
        base_score = float(str(learner["learner_model_param"]["base_score"]).strip("[]"))
        booster = learner["gradient_booster"]
        if booster.get("name") != "gbtree":
            raise UnsupportedModel(f"booster '{booster.get('name')}' (only gbtree)")
        trees = booster["model"]["trees"]
        tree_info = booster["model"].get("tree_info", [0] * len(trees))
        num_target = int(learner["learner_model_param"].get("num_target", "1"))
        num_class = int(learner["learner_model_param"].get("num_class", "0"))
    except UnsupportedModel:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise UnsupportedModel(f"unreadable model document: {error!r}") from error
    if num_target != 1 or num_class > 1 or any(int(group) != 0 for group in tree_info):
        raise UnsupportedModel("more than one output")
    if not 0.0 < base_score < 1.0:
        raise UnsupportedModel(f"base_score {base_score}")

    node_feature: list[int] = []
    node_threshold: list[float] = []
    node_default_left: list[int] = []
    leaves: list[_Leaf] = []
    for number, tree in enumerate(trees):
        _read_tree(number, tree, n_features, node_feature, node_threshold, node_default_left, leaves)

    bias = math.log(base_score / (1.0 - base_score)) + sum(
        leaf.value * math.prod(leaf.zero_fractions) for leaf in leaves
    )
    tables, table_start = _tables(leaves)
    path_start = np.zeros(len(leaves) + 1, dtype=np.int64)
    slot_start = np.zeros(len(leaves) + 1, dtype=np.int64)
    path_node: list[int] = []
    path_left: list[int] = []
    path_slot: list[int] = []
    slot_feature: list[int] = []
    for i, leaf in enumerate(leaves):
        slot = {feature: u for u, feature in enumerate(leaf.features)}
        for split, left, feature in leaf.path:
            path_node.append(split)
            path_left.append(int(left))
            path_slot.append(slot[feature])
        slot_feature.extend(leaf.features)
        path_start[i + 1] = len(path_node)
        slot_start[i + 1] = len(slot_feature)
    return TreeShap(
        n_features=n_features,
        bias=bias,
        node_feature=np.asarray(node_feature, dtype=np.int32),
        node_threshold=np.asarray(node_threshold, dtype=np.float32),
        node_default_left=np.asarray(node_default_left, dtype=np.uint8),
        path_start=path_start,
        path_node=np.asarray(path_node, dtype=np.int32),
        path_left=np.asarray(path_left, dtype=np.uint8),
        path_slot=np.asarray(path_slot, dtype=np.uint8),
        slot_start=slot_start,
        slot_feature=np.asarray(slot_feature, dtype=np.int32),
        table_start=table_start,
        table=tables,
    )


def _read_tree(
    number: int,
    tree: Mapping[str, Any],
    n_features: int,
    node_feature: list[int],
    node_threshold: list[float],
    node_default_left: list[int],
    leaves: list[_Leaf],
) -> None:
    """Append one tree's splits (global indices) and its leaves' paths, checking every index."""
    try:
        left_children = [int(v) for v in tree["left_children"]]
        right_children = [int(v) for v in tree["right_children"]]
        features = [int(v) for v in tree["split_indices"]]
        conditions = [float(v) for v in tree["split_conditions"]]
        default_left = [int(v) for v in tree["default_left"]]
        covers = [float(v) for v in tree["sum_hessian"]]
        split_types = [int(v) for v in tree.get("split_type", [])]
    except (KeyError, TypeError, ValueError) as error:
        raise UnsupportedModel(f"tree {number}: unreadable: {error!r}") from error
    size = len(left_children)
    if size == 0 or any(len(a) != size for a in (right_children, features, conditions, default_left, covers)):
        raise UnsupportedModel(f"tree {number}: arrays of different lengths")
    if any(split_types):
        raise UnsupportedModel(f"tree {number}: categorical splits")
    # (node, path so far, distinct features in order, their zero fractions)
    stack: list[tuple[int, list[tuple[int, bool, int]], list[int], list[float]]] = [(0, [], [], [])]
    visited = 0
    while stack:
        node, path, seen, fractions = stack.pop()
        visited += 1
        if visited > size:
            raise UnsupportedModel(f"tree {number}: not a tree (a node is reached twice)")
        left, right = left_children[node], right_children[node]
        if left == -1:
            if right != -1:
                raise UnsupportedModel(f"tree {number}: node {node} has one child")
            if len(seen) > MAX_PATH_FEATURES:
                raise UnsupportedModel(f"a path of {len(seen)} distinct features (> {MAX_PATH_FEATURES})")
            leaves.append(_Leaf(conditions[node], path, seen, fractions))
            continue
        feature = features[node]
        if not (0 <= left < size and 0 <= right < size and 0 <= feature < n_features):
            raise UnsupportedModel(f"tree {number}: node {node} points outside the tree or the features")
        if covers[node] <= 0.0:
            raise UnsupportedModel(f"tree {number}: node {node} has no cover")
        split = len(node_feature)
        node_feature.append(feature)
        node_threshold.append(conditions[node])
        node_default_left.append(1 if default_left[node] else 0)
        for child, goes_left in ((left, True), (right, False)):
            ratio = covers[child] / covers[node]
            child_seen, child_fractions = list(seen), list(fractions)
            if feature in child_seen:
                child_fractions[child_seen.index(feature)] *= ratio
            else:
                child_seen.append(feature)
                child_fractions.append(ratio)
            stack.append((child, [*path, (split, goes_left, feature)], child_seen, child_fractions))


def _tables(leaves: list[_Leaf]) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Every leaf's ``(2**k, k)`` table of Shapley values by case, flattened, and where each one starts.

    Leaves with the same ``k`` are computed together: for each feature ``i`` the polynomial
    ``prod_{j != i} (z_j + o_j t)`` of every leaf and case at once, then its weighted coefficients.
    """
    sizes = [(1 << len(leaf.features)) * len(leaf.features) for leaf in leaves]
    total = sum(sizes)
    if total > MAX_TABLE_VALUES:
        raise UnsupportedModel(f"tables of {total} values (> {MAX_TABLE_VALUES})")
    starts = np.zeros(len(leaves), dtype=np.int64)
    if leaves:
        starts[1:] = np.cumsum(sizes[:-1])
    table = np.zeros(total, dtype=np.float64)
    by_k: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_k.setdefault(len(leaf.features), []).append(i)
    for k, members in by_k.items():
        if k == 0:
            continue
        values = np.array([leaves[i].value for i in members])[:, None, None]  # (n, 1, 1)
        zero = np.array([leaves[i].zero_fractions for i in members])[:, None, :]  # (n, 1, k)
        cases = np.arange(1 << k)
        one = ((cases[:, None] >> np.arange(k)[None, :]) & 1).astype(np.float64)[None, :, :]  # (1, 2^k, k)
        weights = np.array([1.0 / (k * math.comb(k - 1, s)) for s in range(k)])  # s!(k-s-1)!/k!
        phi = np.empty((len(members), 1 << k, k))
        for i in range(k):
            coefficients = np.zeros((len(members), 1 << k, k))
            coefficients[..., 0] = 1.0
            for j in range(k):
                if j == i:
                    continue
                shifted = np.zeros_like(coefficients)
                shifted[..., 1:] = coefficients[..., :-1] * one[..., j : j + 1]
                coefficients = coefficients * zero[..., j : j + 1] + shifted
            phi[..., i] = values[..., 0] * (one[..., i] - zero[..., i]) * (coefficients @ weights)
        size = (1 << k) * k
        for row, i in enumerate(members):
            table[starts[i] : starts[i] + size] = phi[row].ravel()
    return table, starts
