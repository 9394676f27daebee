"""Streaming text of one sequence: incremental detokenisation and stop strings.

Text is decoded over a short window of tokens (vLLM's prefix/read offsets) so that a character
split over several byte-level tokens appears only once it is complete, and so that tokenizers
that drop a leading space when decoding a lone token still get it right.

Stop strings may span token boundaries. The returned text never contains a stop string: when
stop strings are set, the last ``max(len(stop)) - 1`` characters are held back until more text
shows they do not start one (or the sequence finishes). The concatenated deltas always equal
the final ``text``.

Example: stop=("END",), tokens decode to "abE" then "ND!": the first push returns "a" (holding
"bE"), the second finds "END" and returns "b" with ``stopped`` set; ``text`` is "ab".
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import Tokenizer

# Prompt tokens kept as decoding context for the first output tokens.
INITIAL_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class DetokenizedStep:
    delta: str  # new text to stream
    num_tokens_kept: int  # tokens of this push that count (a stop string ends the sequence there)
    stopped: bool  # a stop string was found


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(prompt_ids) - INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = len(prompt_ids)
        self.text = ""  # output text so far (cut before a stop string)
        self._emitted = 0  # characters of ``text`` already returned
        self.stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _push_one(self, token: int) -> str:
        """Append one token; returns the text it completes ("" while a character is partial)."""
        self._ids.append(token)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""

    def _push_all(self, tokens: list[int]) -> str | None:
        """Append several tokens (a speculative round's accepted ones) with one pair of decodes instead of a pair
        each: the text they complete, where their last one completes a character; else None with nothing appended
        (token by token then, which streams the text before a cut character now, as one token a push would)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        self._ids.extend(tokens)
        full = self._decode(self._prefix_offset)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        del self._ids[-len(tokens):]
        return None

    def _find_stop(self, searched_from: int) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, max(searched_from - len(s) + 1, 0))) >= 0]
        return min(hits) if hits else None

    def _append(self, new_text: str) -> bool:
        """Add decoded text; True when it completes a stop string (the text is cut before it)."""
        before = len(self.text)
        self.text += new_text
        if not self.stop or not new_text:
            return False
        at = self._find_stop(before)
        if at is None:
            return False
        self.text = self.text[:at]
        self.stopped = True
        return True

    def push(self, token_ids: list[int], finished: bool = False) -> DetokenizedStep:
        """Add new output tokens. ``finished``: the sequence ends after them (flush everything)."""
        if self.stopped:
            raise RuntimeError("push after a stop string ended the sequence")
        kept = 0
        whole = None if self.stop or len(token_ids) < 2 else self._push_all(token_ids)
        if whole is not None:
            kept = len(token_ids)
            self._append(whole)
        else:
            for token in token_ids:
                kept += 1
                if self._append(self._push_one(token)):
                    break
        if finished and not self.stopped:
            self._append(self._flush())
        end = len(self.text) if (finished or self.stopped) else max(len(self.text) - self._holdback, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return DetokenizedStep(delta=delta, num_tokens_kept=kept, stopped=self.stopped)

    def _flush(self) -> str:
        """Text of trailing tokens that never completed a character (decoded with U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]
