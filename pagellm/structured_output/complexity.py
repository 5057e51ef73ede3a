"""What a parsed regex or grammar (`syntax`) costs xgrammar: its expansion, and repetitions that
match one text in many ways.

xgrammar matches with an Earley parser: a repetition whose part ends in an unbounded repetition
of what the part can start with (`(a+)+`: "aaa" splits into parts in every way) keeps every split
alive, and the work per token grows with the output (measured: `(a*)*b` 1.8 s a token after 120
tokens, `([a-z]+ ?){1,5}` 0.3 s a token). The check below is the classic star-height test narrowed
by character sets, so that unambiguous nesting (`( [a-z]+)*`, `(\\d+,)*`) passes.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from pagellm.structured_output import charset
from pagellm.structured_output.charset import CharSet
from pagellm.structured_output.syntax import Alt, Node, Ref, Repeat, Seq, quote

_FIXPOINT_ROUNDS = 16
"""Evaluations of each rule, on average, while propagating through references; a grammar that
needs more is taken at its broadest (every rule may be empty and start and end with anything)."""


def expansion(node: Node) -> int:
    """The spec's length with every counted repetition written out (a reference counts 1)."""
    if isinstance(node, Seq):
        return sum(expansion(n) for n in node.items)
    if isinstance(node, Alt):
        return sum(expansion(n) for n in node.options)
    if isinstance(node, Repeat):
        return max(node.high if node.high is not None else node.low, 1) * expansion(node.body)
    return 1


def nodes(node: Node) -> Iterator[Node]:
    """`node` and everything in it."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, Seq):
            stack.extend(n.items)
        elif isinstance(n, Alt):
            stack.extend(n.options)
        elif isinstance(n, Repeat):
            stack.append(n.body)


class Ambiguity:
    """Finds repetitions that match one text in many ways, in a regex or in a grammar's rules. In a
    grammar, a reference stands for what its rule can start with, and for the unbounded
    repetitions its rule can end with (`(word " "?)*` with `word ::= [a-z]+`); recursion (a rule
    that repeats through referring to itself) is not analysed."""

    def __init__(self, rules: Mapping[str, Node] | None = None) -> None:
        self._rules = rules or {}
        self._rule_nullable = dict.fromkeys(self._rules, False)
        self._rule_first: dict[str, CharSet] = dict.fromkeys(self._rules, charset.EMPTY)
        self._rule_tail: dict[str, CharSet] = dict.fromkeys(self._rules, charset.EMPTY)
        self._nullable: dict[int, bool] = {}
        self._first: dict[int, CharSet] = {}
        self._tail: dict[int, CharSet] = {}
        self._unbounded: dict[int, bool] = {}
        self._resolve_rules()

    def find(self, root: Node) -> str | None:
        """How the first ambiguous repetition in `root` is ambiguous, or None."""
        for node in nodes(root):
            if isinstance(node, Repeat) and (node.high is None or node.high > 1):
                if node.high is None and self.nullable(node.body):
                    return f"repeats without bound {quote(node.text)}, whose part can match the empty string"
                inner = self._has_unbounded(node.body) and self._overlap(node.body, self.first(node.body))
                if inner:
                    return (f"repeats {quote(node.text)} around an unbounded repetition ({quote(inner)}) "
                            "that can also match what follows it")
        return None

    def nullable(self, node: Node) -> bool:
        key = id(node)
        if key not in self._nullable:
            if isinstance(node, Seq):
                value = all(self.nullable(n) for n in node.items)
            elif isinstance(node, Alt):
                value = any(self.nullable(n) for n in node.options)
            elif isinstance(node, Repeat):
                value = node.low == 0 or self.nullable(node.body)
            elif isinstance(node, Ref):
                value = self._rule_nullable.get(node.name, False)
            else:
                value = False
            self._nullable[key] = value
        return self._nullable[key]

    def first(self, node: Node) -> CharSet:
        """The characters a match of `node` can start with."""
        key = id(node)
        if key not in self._first:
            if isinstance(node, Seq):
                value = self._first_of_sequence(node.items)
            elif isinstance(node, Alt):
                value = charset.union(*(self.first(n) for n in node.options))
            elif isinstance(node, Repeat):
                value = self.first(node.body)
            elif isinstance(node, Ref):
                value = self._rule_first.get(node.name, charset.ANY)
            else:
                value = node.chars
            self._first[key] = value
        return self._first[key]

    def _first_of_sequence(self, items: tuple[Node, ...]) -> CharSet:
        found = []
        for item in items:
            found.append(self.first(item))
            if not self.nullable(item):
                break
        return charset.union(*found)

    def tail(self, node: Node) -> CharSet:
        """What the unbounded repetitions a match of `node` can end with can start with."""
        key = id(node)
        if key not in self._tail:
            if isinstance(node, Seq):
                found, rest_nullable = [], True
                for item in reversed(node.items):
                    if not rest_nullable:
                        break
                    found.append(self.tail(item))
                    rest_nullable = self.nullable(item)
                value = charset.union(*found)
            elif isinstance(node, Alt):
                value = charset.union(*(self.tail(n) for n in node.options))
            elif isinstance(node, Repeat):
                value = self.tail(node.body)
                if node.high is None:
                    value = charset.union(value, self.first(node.body))
            elif isinstance(node, Ref):
                value = self._rule_tail.get(node.name, charset.ANY)
            else:
                value = charset.EMPTY
            self._tail[key] = value
        return self._tail[key]

    def _overlap(self, node: Node, follow: CharSet) -> str | None:
        """How `node` spells an unbounded repetition in it that what may come after it (`follow`
        after `node`) could continue."""
        if isinstance(node, Seq):
            after = follow
            for item in reversed(node.items):
                found = self._overlap(item, after)
                if found:
                    return found
                after = charset.union(self.first(item), after) if self.nullable(item) else self.first(item)
            return None
        if isinstance(node, Alt):
            return next((found for n in node.options if (found := self._overlap(n, follow))), None)
        if isinstance(node, Repeat):
            starts = self.first(node.body)
            if node.high is None and charset.intersects(starts, follow):
                return node.text
            again = node.high is None or node.high > 1
            return self._overlap(node.body, charset.union(follow, starts) if again else follow)
        if isinstance(node, Ref) and charset.intersects(self.tail(node), follow):
            return node.name
        return None

    def _has_unbounded(self, node: Node) -> bool:
        """Whether `node` holds an unbounded repetition, or refers to a rule that can end in one."""
        key = id(node)
        if key not in self._unbounded:
            if isinstance(node, Seq):
                value = any(self._has_unbounded(n) for n in node.items)
            elif isinstance(node, Alt):
                value = any(self._has_unbounded(n) for n in node.options)
            elif isinstance(node, Repeat):
                value = node.high is None or self._has_unbounded(node.body)
            else:
                value = isinstance(node, Ref) and bool(self.tail(node))
            self._unbounded[key] = value
        return self._unbounded[key]

    def _resolve_rules(self) -> None:
        """Each rule's nullability, first characters and tail, propagated through references: a
        rule is evaluated again whenever a rule it refers to changes, until nothing does."""
        parts = {name: [id(n) for n in nodes(body)] for name, body in self._rules.items()}
        users: dict[str, set[str]] = {name: set() for name in self._rules}
        for name, body in self._rules.items():
            for n in nodes(body):
                if isinstance(n, Ref) and n.name in users:
                    users[n.name].add(name)
        pending, queued = list(self._rules), set(self._rules)
        budget = _FIXPOINT_ROUNDS * len(self._rules)
        while pending and budget:
            name = pending.pop()
            queued.discard(name)
            budget -= 1
            for memo in (self._nullable, self._first, self._tail, self._unbounded):
                for key in parts[name]:
                    memo.pop(key, None)
            body = self._rules[name]
            value = (self.nullable(body), self.first(body), self.tail(body))
            if value != (self._rule_nullable[name], self._rule_first[name], self._rule_tail[name]):
                self._rule_nullable[name], self._rule_first[name], self._rule_tail[name] = value
                for user in users[name] - queued:
                    pending.append(user)
                    queued.add(user)
        if pending:  # not settled: take every rule at its broadest
            self._rule_nullable = dict.fromkeys(self._rules, True)
            self._rule_first = dict.fromkeys(self._rules, charset.ANY)
            self._rule_tail = dict.fromkeys(self._rules, charset.ANY)
        self._forget()

    def _forget(self) -> None:
        for memo in (self._nullable, self._first, self._tail, self._unbounded):
            memo.clear()
