"""Stop-string detection on incrementally detokenized output.

The worker gets token ids in and sends token ids out; the smg gateway
detokenizes. The gateway trims the text at an OpenAI ``stop`` string, but it does
NOT stop the worker (../shared/GATEWAY.md), so the worker detokenizes each
request's output itself, looks for the stop strings, and holds back tokens
while the end of the text could still be the beginning of one.

One :class:`StopStringMatcher` per request (per sample when n > 1), created only
when the request has stop strings::

    m = StopStringMatcher(tok, ["Paris."], prompt_ids, skip_special_tokens=True,
                          spaces_between_special_tokens=True, no_stop_trim=False)
    r = m.push([token])     # every step: r.emit -> stream now; r.matched -> finish "stop"
    rest = m.flush()        # finish for another reason (length, stop token, abort)

Definitions (all positions are Python ``str`` indices, i.e. code points, in
the output text; the prompt is never part of the text):

* The output text after output tokens ``t0..tj`` is ``stable(decode(t0..tj))``:
  the decode with any trailing U+FFFD removed (an unfinished UTF-8 character
  split across byte-level BPE tokens is not text yet). Token ``j`` *ends* at
  ``len`` of that text and *starts* where token ``j - 1`` ends (0 for the
  first). A token whose bytes do not finish a character, or a special token
  under ``skip_special_tokens``, has empty text (start == end).
* A stop string *matches* at position ``i`` when ``text[i:i+len(stop)] == stop``.
  The match reported is the FIRST ONE TO BE COMPLETE in the text: smallest end
  position ``i + len(stop)``; among matches ending at the same position the one
  starting earliest (the longest) wins. Consequently, when one stop string is
  a prefix of another and both occur at the same position, the shorter wins
  (it is complete first). This is what a character-by-character scan sees, so
  the result does not depend on how tokens are grouped into ``push`` calls.
  For non-overlapping occurrences it is the earliest position. Empty stop
  strings are ignored; duplicates are merged.
* Completing token: the first token whose end is >= the match's end.
* Trim rule, when a stop matches at ``i``:

  - ``no_stop_trim=False``: the kept tokens are exactly those whose text
    STARTS before ``i`` (a token straddling the start of the stop string is
    kept; the gateway trims the text itself). A zero-width token at exactly
    ``i`` is not kept.
  - ``no_stop_trim=True``: every token up to and including the completing
    token is kept.

  Tokens after the completing token are never emitted, and nothing is
  accepted after a match.

Hold back (only with ``no_stop_trim=False``; with ``no_stop_trim=True`` every
token before the completing one is kept anyway, so tokens are emitted as soon
as they are pushed): let ``h`` be the length of the longest suffix of the text
that is a proper prefix of some stop string (e.g. the text ends with "Par" and
a stop is "Paris."). A token is emitted once its start is ``< len(text) - h``;
every later match starts at or after that point, so an emitted token is never
one the trim rule drops. (A token's start is known when it is pushed; a token
that only begins an unfinished character may be emitted if it starts before
that point, since every later match starts at or after it too.) Zero-width
tokens at the very end of the text (e.g. a skipped special token) are held
until text follows them, because a stop starting right there would drop them.
``flush()`` returns whatever is held.

``min_tokens``: a stop string that completes while fewer than ``min_tokens``
output tokens have been pushed (counting the completing token) is ignored, as
vLLM ignores stop strings before ``min_tokens``; a later occurrence still
matches.

Incremental detokenization is the HF/vLLM prefix-offset/read-offset method:
decode a small window (the previous group of tokens plus the new ones, seeded
with the last 5 prompt tokens so that leading-space handling, e.g. Metaspace's
dropped first space, matches a decode of prompt + output), and take only the
text past the window's prefix (if the prompt ends inside a UTF-8 character,
the window starts empty instead). Differences from vLLM: text is committed up to
the last complete character even while the window ends in an unfinished one
(so a stop is detected on the token that completes it), and a window that has
grown past ``_MAX_PENDING`` tokens without reaching a character boundary (only
garbage byte sequences do this) is committed as decoded, U+FFFD included, to
keep the cost per token bounded. Each push costs one or two decodes of the
small window per token plus one step of an Aho-Corasick automaton over the
stop strings per new character, whatever the stop strings' number and length:
never a rescan of the text. The automaton (built once per set of stop strings,
in time and memory linear in their total length, and shared by the samples of
a request) gives the hold-back length too: its state's depth is the longest
suffix of the text that begins a stop string. Hand-written because the
matcher needs that depth after every character, which regex engines and
pyahocorasick's finders do not expose.

``skip_special_tokens``: the tokenizer's added tokens marked special (see
:func:`special_token_ids`) contribute no text, so their names cannot be part
of a match; without it they decode to their content, which can match.

``spaces_between_special_tokens`` is accepted and has no effect: with a fast
(``tokenizers``) tokenizer, Hugging Face ignores it too (only the slow Python
tokenizers insert spaces around special tokens), and ``tokenizer.json`` is
always a fast tokenizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["StopResult", "StopStringMatcher", "load_tokenizer", "special_token_ids"]

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the decode window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_WINDOW = 5
# A window that grows this many tokens past its read offset without ending on a
# complete character (or without growing) is committed as is (a UTF-8 character
# is at most 4 bytes, so real text never gets near this).
_MAX_PENDING = 32


class _StopAutomaton:
    """Aho-Corasick over a set of stop strings. State 0 is the empty prefix; a state is a prefix of
    some stop string, `depth[state]` its length. After the text so far, the state is the longest
    suffix of the text that is such a prefix; `longest[state]` is the longest stop string that ends
    there (the state itself or a suffix of it), or None."""

    __slots__ = ("goto", "fail", "depth", "longest")

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[str | None] = [None]
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = goto[state][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    own.append(None)
                state = nxt
            own[state] = stop
        fail = [0] * len(goto)
        longest = list(own)
        queue = list(goto[0].values())
        for state in queue:  # breadth first: a state's fail link is shallower, already done
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                if longest[nxt] is None:
                    longest[nxt] = longest[fail[nxt]]
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.longest = goto, fail, depth, longest

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@functools.lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    """One automaton per set of stop strings (the samples of a request, and requests repeating the
    same stops, share it)."""
    return _StopAutomaton(stops)


def load_tokenizer(tokenizer_dir: str | Path) -> Tokenizer | None:
    """The fast tokenizer from ``tokenizer_dir/tokenizer.json``; None when that file is absent."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return Tokenizer.from_file(str(path))


def special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's added tokens marked special: what ``skip_special_tokens`` skips."""
    return frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)


@dataclass(slots=True)
class StopResult:
    """What one ``push`` produced.

    emit: tokens now safe to stream, in order (after a match: the remaining
    tokens to send under the trim rule; nothing else will ever be emitted).
    matched: the stop string that matched, reported once (on the push where it
    completed); None otherwise.
    unused: on a match, how many of the push's tokens came after the completing one
    (never part of the output: the sample ended before them).
    """

    emit: list[int] = field(default_factory=list)
    matched: str | None = None
    unused: int = 0


class StopStringMatcher:
    """Finds stop strings in one output sequence; see the module docstring for the exact rules."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        prompt_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        no_stop_trim: bool,
        *,
        special_ids: frozenset[int] | None = None,
        min_tokens: int = 0,
    ) -> None:
        """``special_ids``: pass :func:`special_token_ids` (computed once per tokenizer) to
        avoid recomputing it per request; only used with ``skip_special_tokens``.
        ``min_tokens``: stop strings completing before this many output tokens are ignored."""
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        # Documented no-op for fast tokenizers (kept for the record / logging).
        self.spaces_between_special_tokens = bool(spaces_between_special_tokens)
        self._no_trim = bool(no_stop_trim)
        if self._skip:
            self._special = special_ids if special_ids is not None else special_token_ids(tokenizer)
        else:
            self._special = frozenset()

        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._automaton = _automaton(self.stops) if self.stops else None
        self._state = 0  # the automaton's state after the text so far
        self._min_tokens = int(min_tokens)
        self._num_pushed = 0  # output tokens pushed (special ones included)

        # Decode window: _win[:_read] decodes to the prefix text (_prefix_len chars),
        # of which the output text has none; _win_emitted chars past it are committed.
        tail = [int(t) for t in prompt_ids[-_PROMPT_WINDOW:] if int(t) not in self._special]
        prefix = self._decode(tail) if tail else ""
        if prefix.endswith(_REPLACEMENT):
            # The prompt ends inside a character: bytes the output adds would merge with
            # it. Start without context, so the text is what the output alone decodes to.
            tail, prefix = [], ""
        self._win: list[int] = tail
        self._read = len(tail)
        self._prefix_len = len(prefix)
        self._win_emitted = 0

        self._chunks: list[str] = []
        self._len = 0  # len(text)
        # Pushed, not yet emitted: (token id, start position in the text).
        self._held: list[tuple[int, int]] = []
        self._matched: str | None = None
        self._match_pos: int | None = None
        self._finished = False

    # -- public state -------------------------------------------------------
    @property
    def text(self) -> str:
        """The detokenized output text so far (never the prompt). It may run past a
        matched stop string (to the end of the completing token's text); after
        ``flush`` it includes any trailing U+FFFD of an unfinished character."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def matched(self) -> str | None:
        """The stop string that matched, or None."""
        return self._matched

    @property
    def match_position(self) -> int | None:
        """Where in ``text`` the matched stop string starts, or None."""
        return self._match_pos

    @property
    def finished(self) -> bool:
        """True after a match or a flush; later pushes are ignored."""
        return self._finished

    @property
    def num_held(self) -> int:
        """Tokens pushed but not emitted yet."""
        return len(self._held)

    # -- API ------------------------------------------------------------------
    def push(self, token_ids: list[int]) -> StopResult:
        """Feed this step's new token(s). After a match or flush, tokens are ignored
        (an engine may have produced a few more before it learned of the finish)."""
        if self._finished:
            return StopResult()
        for i, t in enumerate(token_ids):
            t = int(t)
            self._num_pushed += 1
            # Token j starts where the text stood after token j - 1.
            self._held.append((t, self._len))
            found = self._feed(t)
            if found is not None:
                result = self._finish_match(*found)
                result.unused = len(token_ids) - i - 1
                return result
        return StopResult(emit=self._release())

    def flush(self) -> list[int]:
        """At a finish that is not a stop-string match: every held-back token (in order).
        The text is completed with whatever the window still decodes to."""
        if self._finished:
            return []
        self._finished = True
        if self._win:
            full = self._decode(self._win)
            rest = full[self._prefix_len + self._win_emitted :]
            if rest:
                self._append(rest)
        out = [t for t, _ in self._held]
        self._held.clear()
        return out

    # -- internals ----------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _feed(self, t: int) -> tuple[int, str] | None:
        """Detokenize one token; returns (match start, stop) when a stop completed."""
        if t in self._special:  # skipped special token: no text, not in the window
            return None
        self._win.append(t)
        full = self._decode(self._win)
        at_boundary = not full.endswith(_REPLACEMENT)
        stable_len = len(full) if at_boundary else len(full.rstrip(_REPLACEMENT))
        forced = len(self._win) - self._read >= _MAX_PENDING
        if forced:  # garbage bytes (or tokens decoding to nothing): bound the window
            stable_len = len(full)
        new_rel = stable_len - self._prefix_len
        found = None
        if new_rel > self._win_emitted:
            chunk = full[self._prefix_len + self._win_emitted : self._prefix_len + new_rel]
            self._win_emitted = new_rel
            found = self._append(chunk)
        if forced or (at_boundary and len(full) > self._prefix_len):
            # vLLM's offset move: the new prefix is what was the read part.
            self._win = self._win[self._read :]
            self._read = len(self._win)
            self._prefix_len = len(self._decode(self._win))
            self._win_emitted = 0
        return found

    def _append(self, chunk: str) -> tuple[int, str] | None:
        """Commit text; feed it to the automaton, character by character, and return (start, stop)
        of the first stop string to complete (the longest of those ending at one character)."""
        start_len = self._len
        self._chunks.append(chunk)
        self._len += len(chunk)
        automaton = self._automaton
        if automaton is None:
            return None
        state, longest, step = self._state, automaton.longest, automaton.step
        for i, ch in enumerate(chunk):
            state = step(state, ch)
            stop = longest[state]
            if stop is not None and self._num_pushed >= self._min_tokens:
                self._state = state
                return start_len + i + 1 - len(stop), stop
        self._state = state
        return None

    def _finish_match(self, start: int, stop: str) -> StopResult:
        self._finished = True
        self._matched = stop
        self._match_pos = start
        if self._no_trim:
            emit = [t for t, _ in self._held]
        else:
            emit = [t for t, s in self._held if s < start]
        self._held.clear()
        return StopResult(emit=emit, matched=stop)

    def _release(self) -> list[int]:
        if self._no_trim or not self.stops:
            out = [t for t, _ in self._held]
            self._held.clear()
            return out
        safe = self._len - self._holdback()
        n = 0
        for _, s in self._held:
            if s >= safe:
                break
            n += 1
        out = [t for t, _ in self._held[:n]]
        del self._held[:n]
        return out

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that begins a stop string."""
        return self._automaton.depth[self._state] if self._automaton is not None else 0
