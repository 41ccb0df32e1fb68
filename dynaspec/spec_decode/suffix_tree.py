"""Suffix trees for model-free drafting: counts of every substring up to a depth, updated per token.

``SuffixTree`` holds token sequences and, for every substring of at most ``max_depth`` tokens, how
many times it occurs in them (its frequency). A node exists only where occurrences branch (a
substring seen at least twice); below its last branch an occurrence is one ``_Leaf`` that reads its
tokens in place from its sequence, so a sequence costs one leaf per token plus the branches it
shares, and a sequence that grows extends its unshared leaves for free. Appending a token walks the
sequence's open suffixes (at most ``max_depth - 1``): O(max_depth) per token, never a rebuild.

A sequence drafts from the tree it is in: its longest suffix that occurred before with a
continuation (at most ``max_depth - max_tokens`` long: the depth bounds match plus draft) is
continued by the most frequent child at each step, each token's probability its frequency over its
parent's, while the product stays at least ``min_token_prob`` and for at most ``max_spec_factor``
times the match length. Each branch keeps its most frequent child as the counts change, so that a
draft costs its length whatever the number of children.

``SuffixIndex`` is what the suffix proposer keeps: a tree per live request over its prompt and
output, and one shared tree over the outputs (each after its prompt's last tokens) of live requests
and of a cache of finished ones, least recently used first out under a token budget.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


class _Node:
    """A substring seen ``count`` times; its children are keyed by the token that follows.

    ``best`` is the token of its most frequent child, the first inserted among equals (what ``max``
    over ``children`` picks), kept as counts change so that drafting never scans the children; it
    is ``None`` where not known (recounted when a draft needs it), with no child, and at the root
    (whose children never begin a draft). ``lead``: at most how many more occurrences the best has
    than any other child (and than 1), so that it stays the best as it loses up to ``lead - 1``."""

    __slots__ = ("best", "children", "count", "lead")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: int | None = None
        self.lead = 0


class _Leaf:
    """One occurrence below its last branch: ``tokens[start + depth : start + max_depth]``, read in
    place (``depth``: that of the node it hangs under). ``node`` is set when a branch reached the
    sequence's last token: the occurrence then ends at that node."""

    __slots__ = ("depth", "node", "start", "tokens")

    def __init__(self, tokens: list[int], start: int, depth: int) -> None:
        self.tokens = tokens
        self.start = start
        self.depth = depth
        self.node: _Node | None = None


class _Sequence:
    __slots__ = ("open", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # where each suffix still shorter than max_depth ends, longest first: open[j] holds
        # tokens[len - len(open) + j:], a _Node or the suffix's own _Leaf
        self.open: list[_Node | _Leaf] = []


@dataclass(slots=True)
class Speculation:
    """A draft continuation and what the tree knows of it."""

    tokens: list[int]
    probs: list[float]  # [len(tokens)] each token's frequency over its parent's (conditional)
    match_len: int = 0  # the suffix of the context it continues
    score: float = 0.0  # expected tokens accepted if the frequencies hold: sum of cumulative probs


NO_SPECULATION = Speculation([], [])


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 2
        self.max_depth = max_depth
        self.root = _Node(0)
        self.num_nodes = 0  # branch nodes (there is one leaf per token besides)
        self.num_tokens = 0
        self._seqs: dict[Hashable, _Sequence] = {}

    def add(self, seq_id: Hashable, tokens: Sequence[int] = ()) -> None:
        assert seq_id not in self._seqs
        self._seqs[seq_id] = _Sequence()
        self.extend(seq_id, tokens)

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence: each adds the suffixes ending at it (O(max_depth))."""
        seq = self._seqs[seq_id]
        seen, opened = seq.tokens, seq.open
        for t in tokens:
            i = len(seen)
            seen.append(t)
            # a suffix seen once ends in its own leaf, which reads t in place; a longer suffix is
            # then seen once too, so those leaves lead the list and only the rest take a step
            shared = len(opened)
            while shared and not (type(at := opened[shared - 1]) is _Leaf and at.node is None):
                shared -= 1
            depth = len(opened) - shared  # of the oldest suffix that steps, tokens[i - depth : i]
            for j in range(shared, len(opened)):
                opened[j] = self._step(opened[j], t, seen, i - depth, depth)
                depth -= 1
            opened.append(self._step(self.root, t, seen, i, 0))
            if len(opened) == self.max_depth:  # the oldest suffix reached the depth: no more steps
                del opened[0]
        self.num_tokens += len(tokens)

    def _step(self, at: _Node | _Leaf, t: int, tokens: list[int], start: int, depth: int) -> _Node | _Leaf:
        """Where tokens[start : start + depth] followed by ``t`` ends, from where it ended before."""
        if type(at) is _Leaf:  # a branch reached the end of its own leaf
            at = at.node
        children = at.children
        child = children.get(t)
        if child is None:  # a last child, seen once: the best only if it is the only one
            if not children and at is not self.root:
                at.best = t
                at.lead = 0
            leaf = _Leaf(tokens, start, depth)
            children[t] = leaf
            return leaf
        if type(child) is _Node:
            count = child.count = child.count + 1
        else:  # another occurrence's leaf: they part below here
            count = 2
            branch = _Node(2)
            children[t] = branch  # in the leaf's place among the children
            self.num_nodes += 1
            nxt = child.start + depth + 1
            if depth + 1 < self.max_depth and nxt < len(child.tokens):
                child.depth = depth + 1
                branch.children[child.tokens[nxt]] = child
                branch.best = child.tokens[nxt]
            else:
                child.node = branch
            child = branch
        best = at.best
        if best == t:
            at.lead += 1
        elif best is not None:  # t's child gained one: it may pass the best or equal it
            other = children[best]
            top = other.count if type(other) is _Node else 1
            if count > top:
                at.best = t
                at.lead = 1
            elif count < top:
                at.lead = min(at.lead, top - count)
            else:  # equals: the first inserted leads
                at.lead = 0
                for key in children:
                    if key in (t, best):
                        at.best = key
                        break
        return child

    def remove(self, seq_id: Hashable) -> None:
        """Forget a sequence: its occurrences leave every count, and nodes left with none go."""
        tokens = self._seqs.pop(seq_id).tokens
        for start in range(len(tokens)):
            node = self.root
            for depth in range(min(self.max_depth, len(tokens) - start)):
                t = tokens[start + depth]
                child = node.children[t]
                if type(child) is _Leaf:
                    assert child.tokens is tokens and child.start == start
                    del node.children[t]
                    if node.best == t:
                        _best_lost(node, 0)
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= _count_nodes(child)
                    if node.best == t:
                        _best_lost(node, 0)
                    break
                if node.best == t:
                    _best_lost(node, child.count)
                node = child
        self.num_tokens -= len(tokens)

    def tokens(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id].tokens

    def count(self, pattern: Sequence[int]) -> int:
        """How many times ``pattern`` (at most max_depth tokens) occurs in the sequences."""
        assert 0 < len(pattern) <= self.max_depth
        node = self.root
        for d, t in enumerate(pattern):
            child = node.children.get(t)
            if child is None:
                return 0
            if type(child) is _Leaf:
                end = min(child.start + self.max_depth, len(child.tokens))
                rest = child.tokens[child.start + d : end]
                return int(list(pattern[d:]) == rest[: len(pattern) - d])
            node = child
        return node.count

    def speculate(
        self, seq_id: Hashable, max_tokens: int, max_spec_factor: float = 1.0, min_token_prob: float = 0.1
    ) -> Speculation:
        """Up to ``max_tokens`` that most often followed the longest suffix of the sequence seen
        before, while their cumulative probability is at least ``min_token_prob``."""
        opened = self._seqs[seq_id].open
        max_match = max(1, self.max_depth - max_tokens)
        n = len(opened)
        for j in range(max(0, n - max_match), n):  # longest suffix first
            at = opened[j]
            if type(at) is _Leaf:  # seen once, unless a branch reached its end since
                at = at.node
                if at is None:
                    continue
            if at.children:
                return self._continue(at, n - j, max_tokens, max_spec_factor, min_token_prob)
        return NO_SPECULATION

    def _continue(
        self, node: _Node, match_len: int, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Speculation:
        limit = min(max_tokens, int(max_spec_factor * match_len), self.max_depth - match_len)
        out = Speculation([], [], match_len)
        total = node.count - 1  # the context's own occurrence ends here and has no continuation
        prob = 1.0
        while len(out.tokens) < limit and node.children:
            t = node.best
            if t is None:
                t = node.best = max(node.children.items(), key=_child_count)[0]
                node.lead = 0
            child = node.children[t]
            p = (child.count if type(child) is _Node else 1) / total
            if prob * p < min_token_prob:
                break
            prob *= p
            out.tokens.append(t)
            out.probs.append(p)
            out.score += prob
            if type(child) is _Leaf:  # one occurrence from here: its tokens, each certain
                first = child.start + child.depth + 1
                end = min(child.start + self.max_depth, len(child.tokens))
                rest = child.tokens[first : first + min(limit - len(out.tokens), end - first)]
                out.tokens += rest
                out.probs += [1.0] * len(rest)
                out.score += prob * len(rest)
                break
            node, total = child, child.count
        return out


def _child_count(item: tuple[int, _Node | _Leaf]) -> int:
    child = item[1]
    return child.count if type(child) is _Node else 1


def _best_lost(node: _Node, count: int) -> None:
    """The node's best child lost an occurrence and has ``count`` left (0: it is gone)."""
    if node.lead >= 2:
        node.lead -= 1
    elif count == 0 or (count == 1 and node.lead == 1):  # every child left is seen once: the first
        node.best = next(iter(node.children), None)
        node.lead = 0
    else:
        node.best = None


def _count_nodes(node: _Node) -> int:
    return 1 + sum(_count_nodes(c) for c in node.children.values() if type(c) is _Node)


@dataclass(slots=True)
class _Live:
    own: SuffixTree  # the request's prompt and output
    shared_id: int  # its sequence in the shared tree
    prompt_key: int


class SuffixIndex:
    """The suffix trees a proposer drafts from: one per live request (its prompt and output) and one
    shared (each request's output after its prompt's last ``max_depth - 1`` tokens, so that requests
    with one prompt, live or cached, draft from each other's outputs from the first token)."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_cached_tokens: int) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.shared = SuffixTree(max_depth)
        self._live: dict[Hashable, _Live] = {}
        # finished outputs in the shared tree, least recently used first: id -> prompt key
        self._cache: OrderedDict[int, int] = OrderedDict()
        self._by_prompt: dict[int, set[int]] = {}  # prompt key -> cached ids
        self.cached_tokens = 0
        self._ids = itertools.count()

    def add(self, key: Hashable, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """A live request; cached outputs of the same prompt become the most recently used."""
        own = SuffixTree(self.max_depth)
        own.add(key, [*prompt, *output])
        live = _Live(own, next(self._ids), hash(tuple(prompt)))
        self.shared.add(live.shared_id, [*prompt[max(0, len(prompt) - self.max_depth + 1) :], *output])
        self._live[key] = live
        for cached in self._by_prompt.get(live.prompt_key, ()):
            self._cache.move_to_end(cached)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        live = self._live[key]
        live.own.extend(key, tokens)
        self.shared.extend(live.shared_id, tokens)

    def finish(self, key: Hashable) -> None:
        """A request ended: its output joins the cache, which evicts the least recently used."""
        live = self._live.pop(key)
        self._cache[live.shared_id] = live.prompt_key
        self._by_prompt.setdefault(live.prompt_key, set()).add(live.shared_id)
        self.cached_tokens += len(self.shared.tokens(live.shared_id))
        while self._cache and (
            len(self._cache) > self.max_cached_requests or self.cached_tokens > self.max_cached_tokens
        ):
            self._evict()

    def drop(self, key: Hashable) -> None:
        """Forget a live request without caching what it generated (preempted: it starts again)."""
        self.shared.remove(self._live.pop(key).shared_id)

    def _evict(self) -> None:
        shared_id, prompt_key = self._cache.popitem(last=False)
        group = self._by_prompt[prompt_key]
        group.discard(shared_id)
        if not group:
            del self._by_prompt[prompt_key]
        self.cached_tokens -= len(self.shared.tokens(shared_id))
        self.shared.remove(shared_id)

    def speculate(
        self, key: Hashable, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Speculation:
        """The better-scoring draft of the request's own tree and the shared one."""
        if max_tokens <= 0:
            return NO_SPECULATION
        live = self._live[key]
        own = live.own.speculate(key, max_tokens, max_spec_factor, min_token_prob)
        shared = self.shared.speculate(live.shared_id, max_tokens, max_spec_factor, min_token_prob)
        return shared if shared.score > own.score else own

    def stats(self) -> dict:
        own_tokens = sum(live.own.num_tokens for live in self._live.values())
        own_nodes = sum(live.own.num_nodes for live in self._live.values())
        return {
            "live_requests": len(self._live),
            "cached_requests": len(self._cache),
            "cached_tokens": self.cached_tokens,
            "tree_tokens": self.shared.num_tokens + own_tokens,
            "tree_nodes": self.shared.num_nodes + own_nodes,
        }
