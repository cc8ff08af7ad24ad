"""Multi-document Kubernetes YAML (or JSON) in and out, for ``shardcache inject``.

The loader is PyYAML's ``SafeLoader`` hardened for input nobody vetted: it refuses documents that
nest deeper than :data:`MAX_YAML_DEPTH`, whose aliases would expand past
:data:`MAX_ALIAS_EXPANSION` or that hold integers longer than :data:`MAX_INT_CHARS`, with the line
and column where it stopped (an :class:`~sidecar.k8s.inject.InjectionError`, one line for the CLI),
and it keeps timestamps as strings. The dumper writes every alias out and multi-line strings in
block style, keys in their original order.
"""

from __future__ import annotations

from typing import Any

import yaml

from sidecar.k8s.inject import InjectionError, shown

__all__ = ["MAX_YAML_DEPTH", "MAX_ALIAS_EXPANSION", "MAX_INT_CHARS", "load_documents", "dump_documents"]


# Bounds of what a document may make the loader build. Kubernetes objects nest a few dozen levels
# at most (CRD schemas included); deeper input only exhausts the recursive composer, deepcopy and
# dumper. Anchors and aliases are shared when loaded but written out in full (kubectl users read
# the output, and the API server would expand them too), so a few hundred bytes of nested aliases
# ("billion laughs") become megabytes: what aliases add is counted and bounded. Helm and kustomize
# output with a few anchors adds hundreds of units, far below the bound.
MAX_YAML_DEPTH = 100
MAX_ALIAS_EXPANSION = 100_000
"""Nodes plus scalar characters that aliases may add to one document."""
MAX_INT_CHARS = 100
"""Kubernetes integers are 64-bit; a longer literal is a mistake (or a CPU bomb for int())."""


class _Refused(yaml.composer.ComposerError):
    """A document the loader will not build (past a bound above); valid YAML, so not "invalid".
    A PyYAML error on purpose, outside :class:`~sidecar.errors.SidecarError`: the composer's
    callers and :func:`load_documents` take it with PyYAML's own, which turns it into an
    :class:`~sidecar.k8s.inject.InjectionError` with its line and column."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(None, None, problem, mark)


class _Loader(yaml.SafeLoader):
    """SafeLoader that keeps timestamps as strings (Kubernetes fields are strings, not dates) and
    refuses documents past the bounds above, with the line and column of where it stopped."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        # Expanded size of each node composed so far in this document (keyed by identity: nodes
        # do not define equality). An anchor missing here is still open: a recursive alias.
        self._sizes: dict[yaml.Node, int] = {}

    def compose_document(self) -> yaml.Node | None:
        self._expanded = 0
        self._sizes = {}
        return super().compose_document()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:  # an undefined alias is PyYAML's own error
                size = self._sizes.get(target)
                if size is None:
                    raise _Refused(
                        f"alias *{shown(event.anchor)[1:-1]} is used inside its own anchor (a recursive "
                        "structure no Kubernetes object has): write the value out",
                        event.start_mark,
                    )
                self._expanded += size
                if self._expanded > MAX_ALIAS_EXPANSION:
                    raise _Refused(
                        f"YAML aliases expand this document past {MAX_ALIAS_EXPANSION} nodes and characters "
                        "(an alias bomb?): if it is meant to be this large, expand its aliases first "
                        "(yq 'explode(.)') and inject the result",
                        event.start_mark,
                    )
            return super().compose_node(parent, index)
        if self._depth >= MAX_YAML_DEPTH:
            raise _Refused(
                f"collections nested more than {MAX_YAML_DEPTH} levels deep: no Kubernetes object is; "
                "check the document",
                event.start_mark,
            )
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is not None:
            self._sizes[node] = self._size(node)
        return node

    def _size(self, node: yaml.Node) -> int:
        # Children (aliases included) were composed first, so their sizes are known.
        if isinstance(node, yaml.ScalarNode):
            return 1 + len(node.value)
        if isinstance(node, yaml.MappingNode):
            return 1 + sum(self._sizes[key] + self._sizes[value] for key, value in node.value)
        return 1 + sum(self._sizes[item] for item in node.value)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"integer of {len(node.value)} characters (Kubernetes integers are 64-bit): "
                'quote it ("...") if it is meant as a string',
                node.start_mark,
            )
        return super().construct_yaml_int(node)


# A private copy: the inherited table is SafeLoader's, shared by every yaml.safe_load in the process.
_Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (scripts in args), so the output stays readable."""

    def ignore_aliases(self, data: Any) -> bool:  # never emit &anchors: kubectl users read this
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def load_documents(text: str, source: str = "<stdin>") -> list[Any]:
    """Parse multi-document YAML (or JSON); empty documents are dropped."""
    try:
        return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        what = "refused YAML" if isinstance(exc, _Refused) else "invalid YAML"
        raise InjectionError(f"{where}: {what}: {' '.join(str(problem).split())}") from exc


def dump_documents(docs: list[Any]) -> str:
    """Write documents back as multi-document YAML, keys in their original order."""
    if not docs:
        return ""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, default_flow_style=False, width=120)
