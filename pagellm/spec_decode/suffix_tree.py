"""A suffix trie of bounded depth with occurrence counts: the index behind suffix decoding.

Every substring of at most `depth` tokens of the inserted sequences is a path from the root, and
each node counts the occurrences of its substring. Appending a token to a sequence extends the
paths of its last `depth - 1` suffixes by one node each (`SuffixTrie.append`), so the work per new
token is `depth` dictionary steps whatever the sequence's length, with no suffix links or edge
splitting to get wrong; removing a sequence decrements the same paths (`remove`), which a compressed
suffix tree or a suffix automaton make far more intricate (the latter cannot remove at all). The
price is memory: up to `depth` nodes per token where the text does not repeat itself (a node is
64 bytes: `TrieNode` keeps its first child in slots and only a branching node holds a dict), which
the proposer bounds with the number of requests it caches.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


class TrieNode:
    """A substring: how often it occurs, and its one-token extensions. The first child sits in
    `token`/`child` (most nodes of a deep trie have one), the others in `more`."""

    __slots__ = ("count", "token", "child", "more")

    def __init__(self) -> None:
        self.count = 0
        self.token = -1
        self.child: TrieNode | None = None
        self.more: dict[int, TrieNode] | None = None

    def get(self, token: int) -> TrieNode | None:
        if self.token == token:
            return self.child
        return None if self.more is None else self.more.get(token)

    def add(self, token: int) -> TrieNode:
        node = TrieNode()
        if self.child is None:
            self.token, self.child = token, node
        else:
            if self.more is None:
                self.more = {}
            self.more[token] = node
        return node

    def drop(self, token: int) -> None:
        if self.token == token:
            if self.more:
                self.token, self.child = self.more.popitem()
                if not self.more:
                    self.more = None
            else:
                self.token, self.child = -1, None
        elif self.more is not None:
            del self.more[token]
            if not self.more:
                self.more = None

    def children(self) -> Iterator[tuple[int, TrieNode]]:
        if self.child is not None:
            yield self.token, self.child
            if self.more is not None:
                yield from self.more.items()


Cursor = list[TrieNode]
"""The nodes of a sequence's latest suffixes, of 0 (the root) to depth - 1 tokens: where its next
token extends the trie."""


class SuffixTrie:
    """The substrings of up to `depth` tokens of the sequences inserted, with their counts."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a suffix trie needs a depth >= 1, got {depth}")
        self.depth = depth
        self.root = TrieNode()

    def cursor(self) -> Cursor:
        """Where a new sequence starts."""
        return [self.root]

    def append(self, cursor: Cursor, tokens: Iterable[int]) -> Cursor:
        """Extend the sequence at `cursor` by `tokens`: each adds one occurrence to the paths of the
        sequence's suffixes ending at it (up to depth tokens). Returns the cursor after them."""
        for token in tokens:
            extended = [self.root]
            for node in cursor[:self.depth]:
                child = node.get(token) or node.add(token)
                child.count += 1
                extended.append(child)
            cursor = extended[:self.depth]
        return cursor

    def insert(self, tokens: Sequence[int]) -> None:
        """Add a whole sequence."""
        self.append(self.cursor(), tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence `insert` added (its counts; nodes no longer occurring go)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.get(token)
                child.count -= 1
                if child.count == 0:  # the other paths below it occur no more often than it
                    node.drop(token)
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> TrieNode | None:
        """The node of `tokens`, None where they do not occur."""
        node: TrieNode | None = self.root
        for token in tokens:
            node = node.get(token)
            if node is None:
                return None
        return node

    def longest_match(self, context: Sequence[int]) -> tuple[TrieNode, int]:
        """The node of the longest suffix of `context` (at most depth - 1 tokens) that occurred
        followed by some token, and its length (0: the root). A suffix that did has shorter ones
        that did too, so a binary search over the length finds it in O(depth log depth)."""
        low, high = 0, min(self.depth - 1, len(context))
        best = self.root
        while low < high:
            mid = (low + high + 1) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and node.child is not None:
                low, best = mid, node
            else:
                high = mid - 1
        return best, low

    @staticmethod
    def continuation(node: TrieNode, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """From `node`, follow the most frequent next token while the path's probability (the
        product of each step's share of its node's continuations) stays >= `min_prob`, up to
        `max_tokens`. Returns the tokens and their expected number accepted (the sum of the
        path's probabilities), by which proposals from several tries compare."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and node.child is not None:
            total = 0
            best_token, best = node.token, node.child
            for token, child in node.children():
                total += child.count
                if child.count > best.count:
                    best_token, best = token, child
            prob *= best.count / total
            if prob < min_prob:
                break
            tokens.append(best_token)
            score += prob
            node = best
        return tokens, score
