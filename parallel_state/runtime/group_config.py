"""``ProcessGroupNode`` / ``ProcessGroupConfig``: a tree of named process groups, in PhysicsNeMo's shapes.

``DistributedManager.create_groups_from_config`` reads a config through what both this class and
PhysicsNeMo's (a treelib tree) offer: ``root``, ``root_id`` and ``tree.children(name)`` giving nodes with
``identifier`` and ``data`` (a node with ``name`` and ``size``). So a config built with either works.
Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from parallel_state.errors import ParallelStateAssertionError, ParallelStateValueError


class ProcessGroupNode:
    """One named process group of a config; ``size`` may be left for ``set_leaf_group_sizes`` to fill in."""

    def __init__(self, name: str, size: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ParallelStateValueError(f"a ProcessGroupNode needs a non-empty str name, got {name!r}")
        self.name = name
        self.size = size

    def __repr__(self) -> str:
        return f"ProcessGroupNode(name={self.name!r}, size={self.size!r})"


@dataclass
class _TreeNode:
    identifier: str
    data: ProcessGroupNode
    parent: str | None
    children: list[str] = field(default_factory=list)


class _Tree:
    """The part of a treelib tree the config and the manager read, nodes kept in insertion order."""

    def __init__(self) -> None:
        self._nodes: dict[str, _TreeNode] = {}

    def add(self, node: ProcessGroupNode, parent: str | None) -> None:
        if node.name in self._nodes:
            raise ParallelStateValueError(f"the config already has a process group named {node.name!r}; "
                                          f"give each group its own name")
        if parent is not None and parent not in self._nodes:
            raise ParallelStateValueError(f"parent {parent!r} of {node.name!r} is not in the config; add it "
                                          f"first (known: {list(self._nodes)})")
        self._nodes[node.name] = _TreeNode(node.name, node, parent)
        if parent is not None:
            self._nodes[parent].children.append(node.name)

    def contains(self, name: str) -> bool:
        return name in self._nodes

    def get_node(self, name: str) -> _TreeNode:
        if name not in self._nodes:
            raise ParallelStateValueError(f"process group {name!r} is not in this config (known: {list(self._nodes)})")
        return self._nodes[name]

    def children(self, name: str) -> list[_TreeNode]:
        return [self._nodes[child] for child in self.get_node(name).children]

    def leaves(self) -> list[_TreeNode]:
        return [node for node in self._nodes.values() if not node.children]


class ProcessGroupConfig:
    """A tree of named process groups under a root (usually "world"); children of one node are orthogonal.

    Set the leaves' sizes (``set_leaf_group_sizes``); each parent's size is then the product of its
    children's. ``DistributedManager.create_groups_from_config(config)`` creates them all.
    """

    def __init__(self, node: ProcessGroupNode) -> None:
        self.root = node
        self.root_id = node.name
        self.tree = _Tree()
        self.tree.add(node, None)

    def add_node(self, node: ProcessGroupNode, parent: str | ProcessGroupNode) -> None:
        """Add ``node`` under ``parent`` (its name, or the node itself), which must already be in the config."""
        self.tree.add(node, parent.name if isinstance(parent, ProcessGroupNode) else parent)

    def get_node(self, name: str) -> ProcessGroupNode:
        """The node named ``name``."""
        return self.tree.get_node(name).data

    def leaf_groups(self) -> list[str]:
        """The names of the groups without children, in the order they were added."""
        return [node.identifier for node in self.tree.leaves()]

    def set_leaf_group_sizes(self, group_sizes: dict[str, int], update_parent_sizes: bool = True) -> None:
        """Set each leaf's size; then (by default) every parent's, as the product of its children's."""
        for name, size in group_sizes.items():
            if not self.tree.contains(name):
                raise ParallelStateAssertionError(f"process group {name!r} is not in this config; "
                                                  f"its leaves are {self.leaf_groups()}")
            node = self.tree.get_node(name)
            if node.children:
                raise ParallelStateAssertionError(f"process group {name!r} is not a leaf (its size is the product "
                                                  f"of its children's); set the sizes of {self.leaf_groups()}")
            node.data.size = size
        if update_parent_sizes:
            self.update_parent_sizes()

    def update_parent_sizes(self, verbose: bool = False) -> int:
        """Set every parent's size to the product of its children's; return the root's."""
        return _product(self.tree, self.root_id, verbose)


def _product(tree: _Tree, name: str, verbose: bool) -> int:
    node = tree.get_node(name)
    if not node.children:
        if node.data.size is None:
            raise ParallelStateAssertionError(f"leaf process group {name!r} has no size; set it with "
                                              f"set_leaf_group_sizes")
        return node.data.size
    product = 1
    for child in node.children:
        product *= _product(tree, child, verbose)
    if node.data.size != product:
        if verbose:
            print(f"Updating size of node {name} from {node.data.size} to {product}")
        node.data.size = product
    return product


def creation_order(config: Any) -> Iterator[tuple[Any, str | None]]:
    """(node, parent group name) in the order the groups are made: the root over the world, then breadth first,
    each child carved out of the groups orthogonal to its previous sibling (the first out of its parent's).

    That keeps the children of one node orthogonal to each other, each block of processes independent.
    """
    yield config.root, None
    queue = [config.root_id]
    while queue:
        name = queue.pop(0)
        parent = name
        for child in config.tree.children(name):
            yield child.data, parent
            parent = orthogonal_name(child.data.name)
            queue.append(child.identifier)


def orthogonal_name(name: str) -> str:
    """The name of the group made orthogonal to each node's group."""
    return f"__orthogonal_to_{name}"
