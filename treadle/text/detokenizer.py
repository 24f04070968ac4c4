"""Incremental detokenization and stop strings.

Each new token costs a decode of a short window (the last few tokens), not of the whole output:
text is emitted only once the window decodes to more than it did without the new token and does
not end in an incomplete UTF-8 sequence (U+FFFD), so multi-byte characters split over several
byte tokens come out whole; bytes that no later token can complete (invalid UTF-8) come out as
U+FFFD after MAX_HELD_TOKENS.
"""

# Prompt tokens kept as left context, so the first output token decodes as it would mid-text
# (leading-space handling of SentencePiece vocabularies depends on it).
INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens: text still ending in U+FFFD after
# that many held tokens holds invalid bytes, which no later token completes. It is emitted (as
# U+FFFD, as llama.cpp sends it) rather than held: held, the window would grow with every token,
# each push decoding all of it.
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.tokens[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.tokens[self.prefix_offset :], self.skip_special_tokens)
        held = len(self.tokens) - self.read_offset
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and held < MAX_HELD_TOKENS):
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window: drop what can no longer change.
        self.tokens = self.tokens[self.read_offset :]
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        return delta


def find_stop_string(text: str, stop_strings: list[str], new_text_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_text_len` characters: (index, string)."""
    best = None
    for stop in stop_strings:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_suffix(text: str, stop_strings: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (held back
    from streaming until it is known whether the stop string completes)."""
    longest = 0
    for stop in stop_strings:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
