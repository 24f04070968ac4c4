"""A suffix tree over token sequences, of bounded depth, with occurrence counts: the index behind
suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; as in Arctic Inference and
vLLM's `"method": "suffix"`).

Every suffix of every sequence, cut to `max_depth` tokens, is a path from the root; a node's
`count` is the number of those suffixes that pass through it or end in it, so from any matched
pattern the counts of the children say how often each continuation followed it. Every suffix ends
at the end of a node's edge, so a count holds along the whole edge. Edges are compressed (a node
holds a slice of one sequence's tokens), and a sequence grows one token at a time: each of its
suffixes still shorter than `max_depth` (at most `max_depth` of them) moves one token down. A
suffix alone at the end of its leaf lengthens the leaf; one whose node sends every other suffix
on into a single child moves the boundary with it instead of making a node; otherwise it enters a
child (cutting a one-token node off the child's edge if the edge is longer) or starts a new leaf.

A node's slice refers to the list of tokens of the sequence that last reshaped it. Removing a
sequence takes its suffixes' counts away and drops the nodes left empty; a node that other
sequences still pass through keeps the removed list alive (the tokens are the same, whoever
holds them).
"""

from collections import deque


class _Node:
    __slots__ = ("count", "children", "parent", "tokens", "start", "length")

    def __init__(self, count: int, parent, tokens: list[int] | None, start: int, length: int, children=None):
        self.count = count
        self.children: dict[int, _Node] | None = children
        self.parent: _Node | None = parent
        self.tokens = tokens
        self.start = start
        self.length = length


class _Sequence:
    __slots__ = ("tokens", "cursors")

    def __init__(self):
        self.tokens: list[int] = []
        # the node where each of its suffixes shorter than max_depth ends, oldest suffix first
        self.cursors: deque[_Node] | None = deque()


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError("a suffix tree needs max_depth >= 2")
        self.max_depth = max_depth
        self.root = _Node(0, None, None, 0, 0, {})
        self._seqs: dict[int, _Sequence] = {}
        self.num_nodes = 1

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to a sequence (a new id starts a new one)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Sequence()
        if seq.cursors is None:
            raise ValueError(f"sequence {seq_id} was closed")
        for t in tokens:
            self._append(seq, int(t))

    def close(self, seq_id: int) -> None:
        """No more tokens for this sequence (its suffixes stay until `remove`)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.cursors = None

    def remove(self, seq_id: int) -> None:
        """Take a sequence's suffixes out of the tree."""
        seq = self._seqs.pop(seq_id)
        toks, depth = seq.tokens, self.max_depth
        for i in range(len(toks)):
            node, pos, left = self.root, i, min(depth, len(toks) - i)
            while left > 0:
                child = node.children[toks[pos]]
                child.count -= 1
                if child.count == 0:  # nothing else passes here: the whole subtree goes
                    del node.children[toks[pos]]
                    self.num_nodes -= _size(child)
                    break
                pos += child.length
                left -= child.length
                node = child

    # ------------------------------------------------------------ growing

    def _append(self, seq: _Sequence, t: int) -> None:
        toks = seq.tokens
        toks.append(t)
        e = len(toks)  # the new token is at e - 1
        cursors = seq.cursors
        cursors.append(self.root)  # the suffix that starts at the new token
        for i, node in enumerate(cursors):
            cursors[i] = self._advance(node, toks, e, t)
        if len(cursors) >= self.max_depth:  # the oldest suffix is max_depth long: done
            cursors.popleft()

    def _advance(self, node: _Node, toks: list[int], e: int, t: int) -> _Node:
        """Move the suffix that ends at `node` on by token t (at toks[e - 1]); where it now ends."""
        children = node.children
        child = children.get(t) if children else None
        inner = node is not self.root
        if child is None:
            if inner and node.count == 1:  # no other suffix reaches here: the leaf grows with it
                node.tokens, node.start = toks, e - 1 - node.length
                node.length += 1
                return node
            leaf = _Node(1, node, toks, e - 1, 1)
            if children is None:
                node.children = children = {}
            children[t] = leaf
            self.num_nodes += 1
            return leaf
        if inner and child.count == node.count - 1:
            # every other suffix through node goes on into child, and only this one ends at node:
            # move node's end one token down instead of making a node
            if child.length == 1:  # node and child become one node
                child.count += 1
                child.tokens, child.start, child.length = toks, e - 1 - node.length, node.length + 1
                child.parent = node.parent
                node.parent.children[toks[child.start]] = child
                self.num_nodes -= 1
                return child
            node.tokens, node.start = toks, e - 1 - node.length
            node.length += 1
            del children[t]
            child.start += 1
            child.length -= 1
            children[child.tokens[child.start]] = child
            return node
        if child.length > 1:  # end at child's first token: cut it off as a node of its own
            upper = _Node(child.count, node, child.tokens, child.start, 1)
            child.start += 1
            child.length -= 1
            child.parent = upper
            upper.children = {child.tokens[child.start]: child}
            children[t] = upper
            self.num_nodes += 1
            child = upper
        child.count += 1
        return child

    # ------------------------------------------------------------ proposing

    def match(self, pattern) -> tuple[_Node, int] | None:
        """Where the pattern ends in the tree, or None if it never occurred."""
        node, idx = self.root, 0
        for t in pattern:
            if idx == node.length:
                node = node.children.get(t) if node.children else None
                if node is None:
                    return None
                idx = 0
            if node.tokens[node.start + idx] != t:
                return None
            idx += 1
        return node, idx

    def speculate(
        self, context, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> tuple[list[int], float]:
        """The most likely continuation of the context: for each pattern length m (its last m
        tokens, shortest first, while they occur), follow the most frequent continuation while its
        estimated probability (the product of count ratios along the way) stays >= min_token_prob,
        for at most min(max_tokens, m x max_spec_factor) tokens; keep the draft with the highest
        score (the sum of its tokens' probabilities; ties go to the longer pattern).
        Returns (tokens, score)."""
        context = list(context[-self.max_depth :])
        best, best_score = [], 0.0
        for m in range(1, len(context)):
            found = self.match(context[len(context) - m :])
            if found is None:
                break
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            draft, score = _follow(*found, limit, min_token_prob)
            if draft and score >= best_score:
                best, best_score = draft, score
        return best, best_score


def _follow(node: _Node, idx: int, limit: int, min_prob: float) -> tuple[list[int], float]:
    out, prob, score = [], 1.0, 0.0
    while len(out) < limit and prob >= min_prob:
        if idx < node.length:
            out.append(node.tokens[node.start + idx])
            score += prob
            idx += 1
            continue
        if not node.children:
            break
        child = max(node.children.values(), key=_count)
        prob *= child.count / node.count
        node, idx = child, 0
    return out, score


def _count(node: _Node) -> int:
    return node.count


def _size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n
