"""A stage's backward in two passes: ``I``, its input's gradient, then ``W``, its weights'.

The previous stage waits only for the input's gradient; the weights' can come later (the
zero-bubble schedules, :mod:`phalanx.pipeline.zero_bubble`). Computing it later must not mean
computing the backward twice: the ``I`` pass runs autograd towards the inputs only (autograd
then skips every branch that leads to weights alone) and, on the way, keeps the gradient that
reaches each node where a weight's branch leaves the input's path (each weight's nearest such
nodes, its *junctions*); the ``W`` pass starts autograd from those junctions with those
gradients and runs only the weights' branches. The graph is kept between the two passes.

Weights whose junctions lie on one another's paths (a weight used twice along the input's
path) would be counted twice from the junctions: for those, and for a stage whose inputs need
no gradient (the first stage), the ``W`` pass is the ordinary backward restricted to the
weights, which recomputes the gradients along the path. Gradients accumulate into ``.grad``
as ``backward()`` would.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightPass", "backward_input", "backward_weight"]


@dataclass(eq=False)
class _Group:
    """Weights that share junctions, and the gradients that reached those junctions."""

    weights: list[torch.Tensor]
    junctions: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightPass:
    """What an ``I`` pass leaves for its ``W`` pass (:func:`backward_weight`)."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    groups: list[_Group]
    whole: list[torch.Tensor]
    """Weights whose gradient ``W`` computes by an ordinary backward restricted to them."""


def _node(t: torch.Tensor) -> Node | None:
    """``t``'s grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _parents(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``, the nodes with an edge to it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    return parents


def _above(start: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node from which one of them is reached."""
    found, queue = set(start), deque(start)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _junctions(weight: Node, path: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nearest nodes on the input's ``path`` above ``weight``'s accumulator (or roots)."""
    found: set[Node] = set()
    seen, queue = {weight}, deque([weight])
    while queue:
        node = queue.popleft()
        ups = parents.get(node, [])
        if not ups:
            found.add(node)  # a root off the input's path: its gradient is the one given
        for parent in ups:
            if parent in path:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return found


def _nested(junctions: list[Node]) -> bool:
    """Whether a junction lies below another (its gradient would be counted twice)."""
    if len(junctions) < 2:
        return False
    others = set(junctions)
    for junction in junctions:
        stack, seen = [child for child, _ in junction.next_functions if child], set()
        while stack:
            node = stack.pop()
            if node in others and node is not junction:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(child for child, _ in node.next_functions if child)
    return False


def _grouped(
    weights: list[torch.Tensor], path: set[Node], parents: dict[Node, list[Node]]
) -> tuple[list[_Group], list[torch.Tensor]]:
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    whole: list[torch.Tensor] = []
    for w in weights:
        node = _node(w)
        junctions = _junctions(node, path, parents) if node is not None else set()
        if not junctions:
            continue
        merged = {id(owner[j]): owner[j] for j in junctions if j in owner}
        group = _Group([w], list(junctions))
        for other in merged.values():
            group.weights += other.weights
            group.junctions += [j for j in other.junctions if j not in group.junctions]
            groups.remove(other)
        groups.append(group)
        for j in group.junctions:
            owner[j] = group
    for group in [g for g in groups if _nested(g.junctions)]:
        groups.remove(group)
        whole += group.weights
    return groups, whole


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None] | None,
    inputs: Sequence[torch.Tensor],
    weights: Iterable[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The ``I`` pass: the gradients of ``inputs`` (None where one needs none; also set as
    their ``.grad``), and what the ``W`` pass needs. ``outputs`` are the stage's outputs that
    require grad, ``grads`` theirs in the same order (None: a scalar loss)."""
    outs = list(outputs)
    given: list[torch.Tensor | None] = [None] * len(outs) if grads is None else list(grads)
    trained = [w for w in weights if w.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    if not outs:
        return [None] * len(inputs), WeightPass([], [], [], [])
    if not wanted:  # the first stage: W runs the whole backward
        return [None] * len(inputs), WeightPass(outs, given, [], trained)
    roots = [n for n in map(_node, outs) if n is not None]
    parents = _parents(roots)
    path = _above([n for n in map(_node, wanted) if n is not None], parents)
    groups, whole = _grouped(trained, path, parents)
    handles = []
    for group in groups:
        for junction in group.junctions:
            if junction in path:
                handles.append(junction.register_prehook(_keep(group, junction)))
    try:
        found = torch.autograd.grad(outs, wanted, given, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    for x, g in zip(wanted, found, strict=True):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    for group in groups:  # junctions off the path are roots: their gradient is the given one
        for junction in group.junctions:
            if junction not in path:
                group.grads[junction] = _root_grads(junction, outs, given)
    return [by_input.get(id(x)) for x in inputs], WeightPass(outs, given, groups, whole)


def _keep(group: _Group, junction: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[junction] = tuple(grad_outputs)

    return hook


def _root_grads(
    root: Node, outs: list[torch.Tensor], given: list[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    mine = [
        (o.output_nr, g if g is not None else torch.ones_like(o))
        for o, g in zip(outs, given, strict=True)
        if o.grad_fn is root
    ]
    grads: list[torch.Tensor | None] = [None] * (1 + max(i for i, _ in mine))
    for i, g in mine:
        grads[i] = g
    return tuple(grads)


def backward_weight(work: WeightPass) -> None:
    """The ``W`` pass: accumulate the weights' gradients into ``.grad``; frees the graph."""
    for group in work.groups:
        edges, grads = [], []
        for junction in group.junctions:
            for i, g in enumerate(group.grads.get(junction, ())):
                if g is not None:
                    edges.append(GradientEdge(junction, i))
                    grads.append(g)
        if not edges:
            continue
        targets = [GradientEdge(_node(w), 0) for w in group.weights]  # type: ignore[arg-type]
        found = torch.autograd.grad(edges, targets, grads, retain_graph=True, allow_unused=True)
        for w, g in zip(group.weights, found, strict=True):
            if g is not None:
                w.grad = g if w.grad is None else w.grad + g
    if work.whole:
        given = [torch.ones_like(o) if g is None else g for o, g in zip(work.outputs, work.grads)]
        torch.autograd.backward(work.outputs, given, inputs=work.whole)
