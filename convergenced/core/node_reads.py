"""`NodeReads`: the small questions the daemon and the simulator ask of a node about
one stream it declared, apart from its status (`NodeCore.status`).

A mixin of `NodeCore`, split off to keep the node's own module about how facts and
records change it; every method here only reads.
"""

from __future__ import annotations

from collections.abc import Callable

from convergenced.core.commits import Verdict, judge
from convergenced.core.facts import Commit, Content, Stored
from convergenced.core.spec import StreamSpec
from convergenced.core.stream_state import StreamState


class NodeReads:
    """Reads of one declared stream (each raises `UnknownStreamError` for another)."""

    _stream: Callable[[str], StreamState]  # NodeCore's

    def judge(self, commit: Commit) -> Verdict:
        """Whether ``commit`` is new here or was sent again (`commits`); check it first.

        Raises:
            UnknownStreamError: the stream is not declared here.
        """
        return judge(self._stream(commit.stream).facts, commit)

    def content(self, commit: Commit) -> Content | None:
        """The digest and size held for the epoch ``commit`` is about (None: none)."""
        return self._stream(commit.stream).facts.content(commit.rank, commit.domain, commit.epoch)

    def located(self, stream: str) -> list[tuple[int, str, int, Content]]:
        """``(rank, domain, epoch, content)`` of every epoch this node's ranks hold
        whose commit said where its bytes are (`locations`), newest epoch first."""
        held = self._stream(stream).facts.contents
        out = [
            (rank, domain, epoch, c)
            for (rank, domain), epochs in held.items()
            for epoch, c in epochs.items()
            if c.location
        ]
        out.sort(key=lambda x: (-x[2], x[0], x[1]))
        return out

    def recovering_from(self, stream: str) -> tuple[int, int] | None:
        """``(generation, restore point)`` of the newest recovery generation resolved
        here, while this node's ranks have committed nothing since it was frozen: the
        job is still restoring from it (None: no such generation). Commits that stated
        no digest, size or location are not seen (they keep no `Content`)."""
        st = self._stream(stream)
        answers = st.generations.answers
        if not answers:
            return None
        g = max(answers)
        rp = answers[g]
        since = (c.after is not None and c.after >= g
                 for held in st.facts.contents.values() for c in held.values())  # fmt: skip
        if rp is None or any(since):
            return None
        return g, rp

    def spec(self, stream: str) -> StreamSpec:
        """The declared spec of ``stream``."""
        return self._stream(stream).facts.spec

    def stored(self, stream: str) -> dict[str, Stored]:
        """Per domain of its policy, what this node's ranks of ``stream`` hold there."""
        return self._stream(stream).facts.stored()

    def restore_point(self, stream: str) -> int | None:
        """Our current restore point of ``stream``."""
        d = self._stream(stream).decision
        return d.restore_point if d else None
