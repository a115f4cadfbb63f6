"""`Detokenizer`: a request's output text, one token at a time, cut at its stop strings.

A token's text may depend on its neighbours (a SentencePiece token's leading space, byte-level
tokens that each hold part of a UTF-8 character, decoders that join pieces), so no token is
decoded alone. The detokenizer decodes a window of tokens that starts where the text was last
whole, ``window + new``, and takes what follows the window's own text; the window begins with
the last prompt tokens, so the first output token reads as it does after the prompt (its
leading space kept). Text ending in U+FFFD, a character whose bytes have not all come, is held
until a later token completes it or the output ends; the text before it is final and is
checked for stop strings at once.

Stop strings (OpenAI's ``stop``): the output ends at the token whose text completes the first
occurrence of any of them, and its text ends just before that occurrence. Text that could still
turn out to begin one (the longest suffix that is a prefix of a stop string) is held back until
it no longer can, or until :meth:`Detokenizer.finish` at an end for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence

_PROMPT_CONTEXT = 4  # prompt tokens decoded before the output, for its first token's text
_INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete


class Detokenizer:
    """The text of one request's output tokens, incrementally.

    ``tokenizer``: anything with ``decode(list[int]) -> str`` (a ``tokenizers.Tokenizer``).
    Feed output tokens in order with :meth:`add`, which returns the text that may be sent now;
    once :attr:`stopped` (a stop string was reached) take no more. At an end for any other
    reason call :meth:`finish` for the text held back. The pieces returned add up to
    :attr:`text`.

    Examples
    --------
    >>> class Chars:  # a toy tokenizer: token i is chr(i)
    ...     def decode(self, ids):
    ...         return "".join(map(chr, ids))
    >>> d = Detokenizer(Chars(), [ord(">")], stop=["cat"])
    >>> [d.add(ord(c)) for c in "a cab cat"]
    ['a', ' ', '', '', 'cab', ' ', '', '', '']
    >>> d.stopped, d.text, d.num_tokens
    (True, 'a cab ', 9)
    """

    def __init__(self, tokenizer, prompt_tokens: Sequence[int], stop: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"Detokenizer: stop strings must be non-empty strings, got {stop!r}")
        self._decode = tokenizer.decode
        self._stop = tuple(stop)
        self._longest = max(map(len, self._stop), default=0)
        self._ids = [int(t) for t in prompt_tokens[-_PROMPT_CONTEXT:]]
        self._start = 0  # the window: ids[_start:_read], whose text is _window_text
        self._read = len(self._ids)
        self._window_text = self._decode(self._ids)
        self._whole = ""  # the output's text up to _read (ends with a whole character)
        self.text = ""  # the text returned so far
        self.stopped = False
        self.num_tokens = 0  # output tokens taken (the last one completed a stop string)

    def add(self, token: int) -> str:
        """Take the next output token; returns the text that may be sent now (maybe "")."""
        if self.stopped:
            raise RuntimeError("Detokenizer.add: the output already reached a stop string")
        self._ids.append(int(token))
        self.num_tokens += 1
        return self._advance(final=False)

    def finish(self) -> str:
        """The output ended for another reason (length, a stop token): the text held back.
        Its last characters, final now, may still complete a stop string (then `stopped`)."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        new = self._decode(self._ids[self._start :])[len(self._window_text) :]
        if final or not new.endswith(_INCOMPLETE):
            self._whole += new  # whole: the window moves past it
            self._start, self._read = self._read, len(self._ids)
            self._window_text = self._decode(self._ids[self._start : self._read])
            text = self._whole
        else:  # the characters before the incomplete one are final
            text = self._whole + new.rstrip(_INCOMPLETE)
        sent = len(self.text)  # no stop string starts before: see _held
        at = min((i for i in (text.find(s, sent) for s in self._stop) if i >= 0), default=-1)
        if at >= 0:
            self.stopped = True
            self._whole = text[:at]
            end = at
        else:
            end = len(text) - (0 if final else self._held(text))
        out = text[sent:end]
        self.text += out
        return out

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that could begin a stop string (not yet sent)."""
        for n in range(min(self._longest - 1, len(text) - len(self.text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
