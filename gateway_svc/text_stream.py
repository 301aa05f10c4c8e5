"""Token ids to text as they arrive: never a broken UTF-8 character, and stop strings cut
exactly, even when one spans several tokens."""

from __future__ import annotations

from turnstile.shared.tokenizer import Tokenizer


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_strings: list[str],
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far, stop string excluded once found
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._prefix_offset = 0
        self._read_offset = 0
        self._hold = max((len(s) for s in stop_strings), default=1) - 1

    def add(self, token_id: int) -> str:
        """Append a token; returns the text that is now safe to emit."""
        self.token_ids.append(token_id)
        tokens = self.token_ids
        skip, decode = self.skip_special_tokens, self.tokenizer.decode
        prefix = decode(tokens[self._prefix_offset : self._read_offset], skip)
        full = decode(tokens[self._prefix_offset :], skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence, or nothing visible yet
        self.text += full[len(prefix) :]
        # Decoding against the previous token keeps spaces and merges as a full decode has them.
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, once no token will follow."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop_strings and not self.stopped:
            window = max(self.emitted - self._hold, 0)
            found = [
                (i, i + len(s) if self.include_stop_str else i, s)
                for s in self.stop_strings
                if (i := self.text.find(s, window)) >= 0
            ]
            if found:
                _, end, self.matched = min(found)
                self.text = self.text[:end]
                self.stopped = True
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        if end <= self.emitted:
            return ""
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` begin `tag` (a tag that may still be coming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
