"""Label and field selectors, as the API server parses them from ``labelSelector`` / ``fieldSelector``.

Labels: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``, comma-joined.
Fields: ``a.b=v``, ``a.b==v``, ``a.b!=v`` on any dotted path of the object (values compared as text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_EQUALITY = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_./]*)$")


class SelectorError(ValueError):
    pass


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # = | != | in | notin | exists | !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        if self.op in ("=", "in"):
            return labels.get(self.key) in self.values
        return labels.get(self.key) not in self.values  # != and notin also match an absent key


def _split_terms(text: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def parse_labels(text: str | None) -> list[Requirement]:
    reqs = []
    for term in _split_terms(text or ""):
        if m := _SET.match(term):
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif m := _EQUALITY.match(term):
            op = "!=" if m.group(2) == "!=" else "="
            reqs.append(Requirement(m.group(1), op, (m.group(3),)))
        elif m := _EXISTS.match(term):
            reqs.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return reqs


def parse_fields(text: str | None) -> list[tuple[str, bool, str]]:
    """``[(dotted path, must equal?, value)]``"""
    reqs = []
    for term in _split_terms(text or ""):
        m = re.match(r"^([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)$", term)
        if m is None:
            raise SelectorError(f"invalid field selector: {term!r}")
        reqs.append((m.group(1), m.group(2) != "!=", m.group(3).strip()))
    return reqs


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _field(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for name in path.split("."):
        node = node.get(name) if isinstance(node, dict) else None
    return node


@dataclass(frozen=True)
class Selector:
    labels: tuple[Requirement, ...] = ()
    fields: tuple[tuple[str, bool, str], ...] = ()

    @classmethod
    def parse(cls, label_selector: str | None, field_selector: str | None) -> Selector:
        return cls(tuple(parse_labels(label_selector)), tuple(parse_fields(field_selector)))

    def matches(self, obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if not all(req.matches(labels) for req in self.labels):
            return False
        return all((_as_text(_field(obj, path)) == value) == equal for path, equal, value in self.fields)
