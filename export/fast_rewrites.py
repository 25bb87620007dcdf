"""onnxscript's default rewrite rules, each tried only on nodes of the op type its pattern ends in.

`torch.onnx.export` optimises its graph with onnxscript, whose rewrite pass tries every default rule on every
node. A rule whose pattern has several output nodes first indexes the whole graph by op type, at every node it is
tried on, so the pass is quadratic in the graph size: most of the optimiser's time on DeiT-small. A pattern can
only match a node whose op type equals that of the pattern's (first) output node, as the matcher checks that
first; skipping other nodes before the matcher runs changes nothing but the time (tests/export/test_export.py checks
the optimised graphs are byte-identical). Rules whose op type is not a fixed string, or that use another
matcher, are tried on every node as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import onnxscript.rewriter as rewriter


class _OpTypeFiltered:
    """A rewrite rule that declines, without matching, nodes of another op type than its pattern's output."""

    def __init__(self, rule: Any, op_type: str) -> None:
        self._rule, self._op_type = rule, op_type

    def __getattr__(self, name: str) -> Any:  # graph_pre_visitor, as_function, name, ...: the rule's own
        return getattr(self._rule, name)

    def try_rewrite(self, model: Any, graph_or_function: Any, node: Any, **kwargs: Any) -> Any:
        if node.op_type != self._op_type:
            return None
        return self._rule.try_rewrite(model, graph_or_function, node, **kwargs)


def output_op_type(rule: Any) -> str | None:
    """The fixed op type a rule's pattern ends in, or None where that is not known (then no filtering)."""
    try:
        from onnxscript.rewriter import _matcher, _pattern_ir

        if type(rule._matcher) is not _matcher.SimplePatternMatcher:
            return None
        op = rule._target_pattern.output_nodes[0].op
        return op._value if type(op) is _pattern_ir.StringConstantPattern else None
    except (AttributeError, ImportError, IndexError):  # another onnxscript layout: leave the rule as it is
        return None


def filtered(rules: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for rule in rules:
        op_type = output_op_type(rule)
        out.append(rule if op_type is None else _OpTypeFiltered(rule, op_type))
    return tuple(out)


@contextmanager
def op_type_filtered_rewrites() -> Iterator[None]:
    """Within: the optimiser's default rules are the filtered ones (onnxscript reads them when it optimises)."""
    saved = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if saved is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = filtered(saved)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = saved
