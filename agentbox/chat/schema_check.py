"""Limits on a JSON schema a request brings (a tool's parameters, a response format), checked in the API process
before a grammar is built from it. Pure Python: no xgrammar here.

Why each limit (measured with xgrammar 0.2.9 and SmolLM2's vocabulary on the 2-core Xeon):
- A schema that admits no finite value (`{"properties": {"child": {"$ref": "#"}}, "required": ["child"]}`) compiles
  in milliseconds, but the closer's `find_jump_forward_string` (engine/grammar.py) then writes the forced
  `{"child": {"child": ...` without end: the engine grew to 16 GB until the kernel's OOM killer ended it. The
  same holds for any subschema the model can enter, an optional property included: once it is open, it must be
  able to end. So every subschema reachable from the root must admit a value of at most MAX_SHORTEST_CHARS
  characters (which also refuses the finite "billion laughs" shapes whose shortest value is astronomically
  long).
- An enum of 100,000 members or a 2.5 MB schema of 20,000 properties did not compile within 5 minutes (1,000
  optional properties: 1.2 s; 3,000: 58 s; 4,000 enum members: 0.1 s).

Every refusal names the schema path where it happens (`tools[0].function.parameters.properties.child`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_BYTES = 256 * 1024  # one schema, serialised
MAX_ENUM_MEMBERS = 4096  # one enum
MAX_PROPERTIES = 1000  # one object's properties
MAX_SHORTEST_CHARS = 65536  # the shortest JSON value a reachable subschema admits, at most
INF = MAX_SHORTEST_CHARS + 1  # "longer than the limit, or no finite value at all"
MAX_REF_ROUNDS = 64  # rounds of the $ref fixed point (each walks the schema once): two or three for real schemas

# The keywords whose values are subschemas a value can enter (what xgrammar's converter reads).
ONE = ("additionalProperties", "items", "unevaluatedProperties", "additionalItems", "contains")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions")


class SchemaRefused(ValueError):
    """A schema past a limit: `path` is where, the message why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def check_schema(schema: Any, path: str) -> None:
    """Raises SchemaRefused when `schema` (a decoded JSON schema found at `path` of the request) is past a limit."""
    for sub, where in _subschemas(schema, path):
        enum = sub.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_ENUM_MEMBERS:
            raise SchemaRefused(f"{where}.enum", f"{len(enum):,} members; the limit is {MAX_ENUM_MEMBERS:,}")
        props = sub.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            raise SchemaRefused(f"{where}.properties", f"{len(props):,} properties; the limit is {MAX_PROPERTIES:,}")
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaRefused(path, f"the schema is {size:,} bytes; the limit is {MAX_SCHEMA_BYTES:,}")
    Shortest(schema).check(path)


def _subschemas(schema: Any, path: str) -> Iterator[tuple[dict, str]]:
    """Every object schema inside `schema` (refs not followed), with its path."""
    stack = [(schema, path)]
    while stack:
        s, where = stack.pop()
        if not isinstance(s, dict):
            continue
        yield s, where
        for key in ONE:
            if isinstance(s.get(key), dict):
                stack.append((s[key], f"{where}.{key}"))
        for key in MANY:
            if isinstance(s.get(key), list):
                stack.extend((x, f"{where}.{key}[{i}]") for i, x in enumerate(s[key]))
        for key in NAMED:
            if isinstance(s.get(key), dict):
                stack.extend((x, f"{where}.{key}.{name}") for name, x in s[key].items())


class Shortest:
    """The length of the shortest JSON value each subschema admits (compact JSON, as the grammar writes it),
    capped at INF. `$ref` targets are solved as a least fixed point: a target starts at INF and comes down as
    shorter values are found, so a schema that needs itself without end stays at INF. Approximate where the
    grammar is subtler (allOf takes the largest part), exact where it matters: finite or not."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.refs: dict[str, int] = {}  # ref string -> its target's shortest value, as solved so far
        self._memo: dict[int, int] | None = None  # id(subschema) -> its value, once the refs are solved
        self._solve()
        self._memo = {}

    def _solve(self) -> None:
        # Collect every ref reachable from the root, then iterate: each round re-evaluates every target with the
        # last round's values. A least fixed point of a min/sum system over N refs is reached within N + 1 rounds
        # (a shortest derivation never repeats a ref on a path); usually in two or three.
        todo = [self.root]
        while todo:
            for sub, _ in _subschemas(todo.pop(), ""):
                ref = sub.get("$ref")
                if isinstance(ref, str) and ref not in self.refs:
                    self.refs[ref] = INF
                    target = self.target(ref)
                    if target is not None:
                        todo.append(target)
        for _ in range(min(len(self.refs) + 1, MAX_REF_ROUNDS)):
            changed = False
            for ref in self.refs:  # in place: a value found is used at once (fewer rounds)
                n = self.length(self.target(ref))
                changed |= n != self.refs[ref]
                self.refs[ref] = n
            if not changed:
                return
        # Not settled: values only come down, so what is still INF may be finite after all; a schema whose refs
        # need this many rounds is no tool's (each round walks the schema), so it stays refused.

    def target(self, ref: str) -> Any:
        """The local schema `ref` points to (`#`, `#/$defs/x`, any JSON pointer), or None (not local, or absent:
        xgrammar's converter names that error itself)."""
        if not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in ref[1:].lstrip("/").split("/") if ref[1:] else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def length(self, s: Any) -> int:
        memo = self._memo
        if memo is not None and isinstance(s, dict):
            if id(s) not in memo:
                memo[id(s)] = self._length(s)
            return memo[id(s)]
        return self._length(s)

    def _length(self, s: Any) -> int:
        if s is None or s is True or s == {}:
            return 1  # anything: `0`
        if s is False or not isinstance(s, dict):
            return INF  # `false` admits no value
        parts = []
        ref = s.get("$ref")
        if isinstance(ref, str):
            parts.append(self.refs.get(ref, INF) if self.target(ref) is not None else 1)
        if "const" in s:
            parts.append(len(json.dumps(s["const"], separators=(", ", ": "))))
        if isinstance(s.get("enum"), list):
            parts.append(min((len(json.dumps(v, separators=(", ", ": "))) for v in s["enum"]), default=INF))
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                parts.append(min((self.length(x) for x in s[key]), default=INF))
        if isinstance(s.get("allOf"), list):
            parts.append(max((self.length(x) for x in s["allOf"]), default=1))
        kinds = s.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if not isinstance(kinds, list):
            kinds = ["object"] if "properties" in s or "required" in s else ["array"] if "items" in s else []
        if kinds:
            parts.append(min(self._typed(s, k) for k in kinds))
        return min(INF, max(parts, default=1))

    def _typed(self, s: dict, kind: Any) -> int:
        if kind == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            extra = s.get("additionalProperties", True)
            n = 2
            for i, name in enumerate(s.get("required") or []):
                sub = props.get(name, extra) if isinstance(name, str) else False
                n += len(json.dumps(name)) + 2 + self.length(sub) + (2 if i else 0)
            return min(n, INF)
        if kind == "array":
            low = s.get("minItems", 0)
            low = low if isinstance(low, int) else 0
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            items = s.get("items", True)
            n = 2
            for i in range(min(max(low, 0), INF)):
                n += self.length(prefix[i] if i < len(prefix) else items) + (2 if i else 0)
                if n >= INF:
                    return INF
            return n
        if kind == "string":
            low = s.get("minLength", 0)
            return min(INF, 2 + (low if isinstance(low, int) and low > 0 else 0))
        if kind in ("boolean", "null"):
            return 4
        if kind in ("integer", "number"):
            return 1
        return 1  # an unknown type: xgrammar's converter refuses it with its own message

    def check(self, path: str) -> None:
        """Raises SchemaRefused at the first reachable subschema (pre-order, refs followed once) whose shortest
        value is INF, explained down to the `$ref` that closes the loop where there is one."""
        seen: set[int] = set()
        stack = [(self.root, path)]
        while stack:
            s, where = stack.pop()
            if not isinstance(s, dict) or id(s) in seen:
                continue
            seen.add(id(s))
            if self.length(s) >= INF:
                raise self._explain(s, where)
            ref = s.get("$ref")
            if isinstance(ref, str) and (t := self.target(ref)) is not None:
                stack.append((t, f"{where}.$ref"))
            stack.extend(reversed([(sub, p) for sub, p in _children(s, where)]))

    def _explain(self, s: dict, where: str) -> SchemaRefused:
        """Follow what makes `s` endless (a required property, a minimum item, a ref) down to a `$ref` to a
        schema already on the way: that is where the loop closes."""
        on_way: list[int] = []
        while True:
            on_way.append(id(s))
            ref = s.get("$ref")
            if isinstance(ref, str) and (t := self.target(ref)) is not None and self.refs.get(ref, INF) >= INF:
                if id(t) in on_way:
                    return SchemaRefused(where, f"'$ref': {ref!r} requires the schema again without end, so no "
                                                "finite JSON value satisfies it; make the recursion optional")
                s, where = t, where
                continue
            nxt = next(((sub, p) for sub, p in _needed(s, where) if self.length(sub) >= INF), None)
            if nxt is None or not isinstance(nxt[0], dict) or id(nxt[0]) in on_way:
                return SchemaRefused(where, f"the shortest JSON value this schema admits is longer than "
                                            f"{MAX_SHORTEST_CHARS:,} characters, or there is none")
            s, where = nxt


def _children(s: dict, where: str) -> Iterator[tuple[Any, str]]:
    """The subschemas directly inside s that a value can enter, in document order, with their paths."""
    for key, value in s.items():
        if key in ONE and isinstance(value, dict):
            yield value, f"{where}.{key}"
        elif key in MANY and isinstance(value, list):
            yield from ((x, f"{where}.{key}[{i}]") for i, x in enumerate(value))
        elif key in ("properties", "patternProperties") and isinstance(value, dict):
            yield from ((x, f"{where}.{key}.{name}") for name, x in value.items())


def _needed(s: dict, where: str) -> Iterator[tuple[Any, str]]:
    """The subschemas every value of s must contain: required properties, the first minItems items, allOf parts,
    and (when every branch is endless) the first anyOf / oneOf branch."""
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    for name in s.get("required") or []:
        if isinstance(name, str):
            if name in props:
                yield props[name], f"{where}.properties.{name}"
            else:
                yield s.get("additionalProperties", True), f"{where}.additionalProperties"
    if isinstance(s.get("minItems"), int) and s["minItems"] > 0:
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        if prefix:
            yield prefix[0], f"{where}.prefixItems[0]"
        else:
            yield s.get("items", True), f"{where}.items"
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(s.get(key), list) and s[key]:
            yield s[key][0], f"{where}.{key}[0]"
