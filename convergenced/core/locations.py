"""Where the bytes of a committed epoch lie: the optional ``location`` of a commit.

A rank that commits an epoch may say where its bytes are, so that the daemon can read
them again later and check them against the digest it committed (background
verification, drills: ``docs/verification.md``). The protocol never looks at it: the
core keeps it beside the digest and size of the epoch held (`facts.Content`), in the
log and through compaction, and forgets it with the epoch. It is never sent to peers:
only this node's verifier reads its own ranks' bytes.

A location names one of the two digest recipes the integrations use, so a verifier
needs no knowledge of a store's layout:

* ``shard``: one shard file (`convergenced.integrations.shards`) at ``url``; the
  digest is the SHA-256 of the payload, the bytes after the header line.
* ``files``: the files ``names`` in the folder ``url`` (a rank's files of a PyTorch DCP
  checkpoint); the digest is the SHA-256 over, for each name in sorted order, the
  name, a NUL byte, its size as 8 bytes big-endian, then its bytes
  (`convergenced.integrations.dcp_storage.files_digest`).

``url`` is a ``file://`` URL or any URL an fsspec filesystem reads (``s3://...``). It
is kept as canonical JSON text (`Location.to_text`), which is what the log holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from convergenced.core.validate import as_list, as_map, as_str, exact_keys, fail

__all__ = [
    "KINDS",
    "MAX_LOCATION_NAMES",
    "MAX_LOCATION_NAME_CHARS",
    "MAX_LOCATION_URL_CHARS",
    "Location",
    "parse_location",
]

KINDS: Final = ("shard", "files")
MAX_LOCATION_URL_CHARS: Final = 1024
MAX_LOCATION_NAMES: Final = 64
"""A rank's files in one checkpoint (DCP writes one or a few per rank)."""
MAX_LOCATION_NAME_CHARS: Final = 255
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S+\Z")
"""A scheme and a non-empty rest without blanks (``file:///...``, ``s3://b/k``)."""


@dataclass(frozen=True, slots=True)
class Location:
    """A checked location (see the module docstring)."""

    kind: str
    url: str
    names: tuple[str, ...] = ()
    """The files in the folder ``url`` (kind ``files``), sorted; empty for a shard."""

    def to_text(self) -> str:
        """The canonical JSON text the log keeps (equal locations, equal texts)."""
        body: dict[str, Any] = {"kind": self.kind, "url": self.url}
        if self.kind == "files":
            body["names"] = list(self.names)
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> Location:
        """Parse what `to_text` wrote.

        Raises:
            RemoteProtocolError: not a location (a damaged log, or not one of ours).
        """
        try:
            value = json.loads(text)
        except ValueError:
            raise fail("location", "not JSON") from None
        return parse_location(value, "location")

    def to_wire(self) -> dict[str, Any]:
        """The map a client sends (and the state shows)."""
        body: dict[str, Any] = {"kind": self.kind, "url": self.url}
        if self.kind == "files":
            body["names"] = list(self.names)
        return body


def parse_location(value: Any, path: str) -> Location:
    """Check a location map from a client: ``{kind, url}`` for a shard, ``{kind, url,
    names}`` for files.

    Raises:
        RemoteProtocolError: naming the offending field; nothing is kept.
    """
    m: Mapping[Any, Any] = as_map(value, path, max_len=3)
    kind = as_str(m.get("kind"), f"{path}.kind", max_len=16)
    if kind not in KINDS:
        raise fail(f"{path}.kind", f"{kind!r} is not one of {', '.join(KINDS)}")
    exact_keys(m, path, ("kind", "url", "names") if kind == "files" else ("kind", "url"))
    url = as_str(m["url"], f"{path}.url", max_len=MAX_LOCATION_URL_CHARS)
    if not _URL.match(url):
        raise fail(f"{path}.url", f"{url[:80]!r} is not a URL (scheme://...)")
    if kind == "shard":
        return Location(kind, url)
    raw = as_list(m["names"], f"{path}.names", max_len=MAX_LOCATION_NAMES)
    if not raw:
        raise fail(f"{path}.names", "empty: name the rank's files")
    names = []
    for i, n in enumerate(raw):
        name = as_str(n, f"{path}.names[{i}]", max_len=MAX_LOCATION_NAME_CHARS)
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise fail(f"{path}.names[{i}]", f"{name!r} is not a file name")
        names.append(name)
    if len(set(names)) != len(names):
        raise fail(f"{path}.names", "a name appears twice")
    return Location(kind, url, tuple(sorted(names)))
