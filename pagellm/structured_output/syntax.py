"""The structure of a regex or an EBNF grammar, as far as the complexity check needs it.

The parsers are tolerant: they never reject (xgrammar decides what is valid), and what they do not
know becomes something at least as broad (an unknown macro is any character, a lookaround matches
nothing), so a spec cannot look simpler to the check than it is. Regexes are read as xgrammar reads
them (JavaScript's syntax; Python's named groups and inline flags are skipped over too); grammars
in xgrammar's EBNF (`name ::= body` a line, strings, classes, groups, `* + ? {m,n}`).
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Union

from pagellm.structured_output import charset
from pagellm.structured_output.charset import CharSet
from pagellm.structured_output.errors import LimitExceeded


@dataclass(frozen=True, slots=True, eq=False)
class Chars:
    """One character of a set."""

    chars: CharSet


@dataclass(frozen=True, slots=True, eq=False)
class Seq:
    items: tuple["Node", ...]


@dataclass(frozen=True, slots=True, eq=False)
class Alt:
    options: tuple["Node", ...]


@dataclass(frozen=True, slots=True, eq=False)
class Repeat:
    body: "Node"
    low: int
    high: int | None
    """None: unbounded."""
    text: str
    """How the spec spells it, for messages."""


@dataclass(frozen=True, slots=True, eq=False)
class Ref:
    """A grammar rule, by name."""

    name: str


Node = Union[Chars, Seq, Alt, Repeat, Ref]
NOTHING = Seq(())
"""Matches the empty string (anchors, lookarounds, the empty string literal)."""

_COUNT = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")
_CONTROL = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
_RULE = re.compile(r"^[ \t]*([A-Za-z_][\w.\-]*)[ \t]*::=", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_MESSAGE_CHARS = 60
_MAX_COUNT_DIGITS = 18


class _Parser:
    """Alternation, sequence and quantified atoms, with groups nested at most `max_depth` deep;
    the atoms are the subclass's."""

    lazy_suffix = False
    """Whether `?` or `+` right after a quantifier modifies it (regex) or quantifies again (EBNF)."""

    def __init__(self, text: str, max_depth: int) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0
        self.max_depth = max_depth

    def parse(self) -> Node:
        parts = [self.alternation()]
        while self.pos < len(self.text):  # an unbalanced ")": xgrammar rejects it; read on
            self.pos += 1
            parts.append(self.alternation())
        return parts[0] if len(parts) == 1 else Seq(tuple(parts))

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.text[i] if i < len(self.text) else ""

    def skip_space(self) -> None:
        """Between atoms: nothing in a regex, whitespace and comments in a grammar."""

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self) -> Node:
        items = []
        while True:
            self.skip_space()
            if self.peek() in ("", "|", ")"):
                break
            start = self.pos
            items.append(self.quantified(self.atom(), start))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def group(self) -> Node:
        """The inside of a group whose "(" was read, and its ")"."""
        self.depth += 1
        if self.depth > self.max_depth:
            raise LimitExceeded(f"nests groups more than {self.max_depth} deep", "max_depth")
        node = self.alternation()
        if self.peek() == ")":
            self.pos += 1
        self.depth -= 1
        return node

    def quantified(self, atom: Node, start: int) -> Node:
        for stacked in range(self.max_depth + 1):
            self.skip_space()
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (m := _COUNT.match(self.text, self.pos)) and (m[1] or m[3]):
                self.pos = m.end()
                low = _count(m[1] or "0")
                high = low if not m[2] else (_count(m[3]) if m[3] else None)
            else:
                return atom
            atom = Repeat(atom, low, high, self.text[start:self.pos])
            if self.lazy_suffix:
                if self.peek() in ("?", "+"):
                    self.pos += 1
                return atom
        raise LimitExceeded(f"stacks more than {self.max_depth} repetitions on one part", "max_depth")

    def atom(self) -> Node:
        raise NotImplementedError

    def skip_past(self, end: str) -> None:
        """To just after the next `end` beyond the current character (the end of the text if none)."""
        found = self.text.find(end, self.pos + 1)
        self.pos = len(self.text) if found < 0 else found + 1

    def char_class(self) -> CharSet:
        """A class whose "[" was read, and its "]"."""
        negate = self.peek() == "^"
        self.pos += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while self.pos < len(self.text):
            if self.peek() == "]" and not first:
                self.pos += 1
                break
            first = False
            low = self._class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", "") and _single(low):
                self.pos += 1
                high = self._class_atom()
                if _single(high):
                    ranges.append((low[0][0], high[0][0]))
                    continue
                ranges.extend((*high, (ord("-"), ord("-"))))
            ranges.extend(low)
        chars = charset.of(*ranges)
        return charset.complement(chars) if negate else chars

    def _class_atom(self) -> CharSet:
        c = self.peek()
        self.pos += 1
        if c == "\\":
            return self.escape(in_class=True) or charset.EMPTY
        return charset.char(c)

    def escape(self, in_class: bool) -> CharSet | None:
        """The characters of an escape whose backslash was read; None for an anchor (`\\b`)."""
        c = self.peek()
        self.pos += 1
        if c == "":
            return charset.char("\\")
        if c in charset.CLASS_ESCAPES:
            return charset.CLASS_ESCAPES[c]
        if c in "bB" and not in_class or c in "AZzG":
            return None
        if c in "xuU":
            if c == "u" and self.peek() == "{":
                end = self.text.find("}", self.pos)
                code, after = (self.text[self.pos + 1:end], end + 1) if end > 0 else ("", self.pos)
            else:
                after = self.pos + {"x": 2, "u": 4, "U": 8}[c]
                code = self.text[self.pos:after] if after <= len(self.text) else ""
            if code and all(h in string.hexdigits for h in code) and int(code, 16) <= charset.MAX_CODE_POINT:
                self.pos = after
                return ((int(code, 16), int(code, 16)),)
            return charset.char(c)
        if c in _CONTROL:
            return charset.char(_CONTROL[c])
        if c == "b":  # in a class: backspace
            return charset.char("\b")
        if c in "pPk" and self.peek() in ("{", "<"):  # a Unicode property or a named backreference
            self.skip_past("}" if self.peek() == "{" else ">")
            return charset.ANY
        if c.isdigit():  # a backreference
            while self.peek().isdigit():
                self.pos += 1
            return charset.ANY
        return charset.char(c)


class _RegexParser(_Parser):
    lazy_suffix = True

    def atom(self) -> Node:
        c = self.peek()
        self.pos += 1
        if c == "(":
            return self._group_after_paren()
        if c == "[":
            return Chars(self.char_class())
        if c == ".":
            return Chars(charset.ANY)
        if c in "^$":
            return NOTHING
        if c == "\\":
            chars = self.escape(in_class=False)
            return NOTHING if chars is None else Chars(chars)
        return Chars(charset.char(c))

    def _group_after_paren(self) -> Node:
        if self.peek() != "?":
            return self.group()
        self.pos += 1
        if self.peek() in ("=", "!") or self.text.startswith(("<=", "<!"), self.pos):  # a lookaround
            self.pos += 1 if self.peek() in ("=", "!") else 2
            self.group()
            return NOTHING
        if self.peek() == "#" or self.text.startswith("P=", self.pos):  # a comment, a backreference
            comment = self.peek() == "#"
            self.skip_past(")")
            return NOTHING if comment else Chars(charset.ANY)
        if self.peek() in ("<", "'") or self.text.startswith("P<", self.pos):  # a named group
            self.skip_past("'" if self.peek() == "'" else ">")
            return self.group()
        while self.peek().isalpha() or self.peek() == "-":  # inline flags: (?i) or (?i:...)
            self.pos += 1
        if self.peek() == ")":
            self.pos += 1
            return NOTHING
        self.pos += self.peek() == ":"
        return self.group()


class _GrammarParser(_Parser):
    def skip_space(self) -> None:
        while True:
            while self.peek().isspace():
                self.pos += 1
            if self.peek() != "#":
                return
            end = self.text.find("\n", self.pos)
            self.pos = len(self.text) if end < 0 else end

    def atom(self) -> Node:
        c = self.peek()
        self.pos += 1
        if c == '"':
            return Seq(tuple(Chars(chars) for chars in self._string()))
        if c == "[":
            return Chars(self.char_class())
        if c == "(":
            self.skip_space()
            if self.peek() == "=":  # a lookahead assertion
                self.pos += 1
                self.group()
                return NOTHING
            return self.group()
        name = _NAME.match(self.text, self.pos - 1)
        if name is None:  # not EBNF: xgrammar rejects it
            return NOTHING
        self.pos = name.end()
        if self.peek() != "(":
            return Ref(name[0])
        return self._macro()

    def _macro(self) -> Node:
        """A macro call (`Regex("...")`, `TagDispatch(...)`): a regex argument is checked as one, any
        other macro is one character of any kind (what it spans is not known here)."""
        self.pos += 1
        self.depth += 1
        if self.depth > self.max_depth:
            raise LimitExceeded(f"nests groups more than {self.max_depth} deep", "max_depth")
        regexes, level = [], 1
        while self.pos < len(self.text) and level:
            c = self.peek()
            self.pos += 1
            if c == '"':
                regexes.append("".join(chr(chars[0][0]) for chars in self._string()))
            level += (c == "(") - (c == ")")
        self.depth -= 1
        if len(regexes) == 1:
            return _RegexParser(regexes[0], self.max_depth - self.depth).parse()
        return Chars(charset.ANY)

    def _string(self) -> list[CharSet]:
        """The characters of a string literal whose opening quote was read, and its closing quote."""
        chars = []
        while self.pos < len(self.text) and self.peek() != '"':
            c = self.peek()
            self.pos += 1
            chars.append((self.escape(in_class=True) or charset.EMPTY) if c == "\\" else charset.char(c))
        self.pos += 1
        return [c for c in chars if _single(c)]


def parse_regex(text: str, max_depth: int) -> Node:
    """The structure of a regex; LimitExceeded when its groups nest deeper than `max_depth`."""
    return _RegexParser(text, max_depth).parse()


def parse_grammar(text: str, max_depth: int) -> dict[str, Node]:
    """Each rule of an EBNF grammar by name (a rule defined twice: the last); LimitExceeded when
    its parentheses nest deeper than `max_depth`."""
    heads = list(_RULE.finditer(text))
    return {head[1]: _GrammarParser(text[head.end():end], max_depth).parse()
            for head, end in zip(heads, [h.start() for h in heads[1:]] + [len(text)])}


def quote(text: str) -> str:
    """`text` for a message, shortened."""
    return repr(text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "...")


def _count(digits: str) -> int:
    """A repetition count; one of more digits than any limit is cut (int() refuses 4,300 digits)."""
    return int((digits.lstrip("0") or "0")[:_MAX_COUNT_DIGITS])


def _single(chars: CharSet) -> bool:
    return len(chars) == 1 and chars[0][0] == chars[0][1]
