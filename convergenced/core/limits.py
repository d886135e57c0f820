"""The limits of what a spec, a fact and a record may hold: one set, for everyone.

A record a node publishes is read by every peer, and a peer refuses (and closes the
link on) a record past any of these limits. So the node that makes a record must
never accept, from its own clients, an input that would take its record past them:
the local API's admission (`admission`), the spec's own checks (`spec`), the record
codec (`records`) and the local API codec (`local_api_codec`) all read their limits
from here, never from a copy. How each record limit is kept:

* ``newest`` entries (`MAX_DOMAINS`): a record names the newest epoch of the policy's
  domains only, a spec names at most `MAX_POLICY_DOMAINS` domains, and a commit to a
  domain the policy does not name is refused (``unknown_domain``);
* frozen sets of open generations (`MAX_GENERATIONS`): freezing one more closes the
  oldest (`generations`);
* ranges of an interval set (`MAX_RANGES`): the recoverable and frozen sets a record
  carries keep their newest `MAX_RANGES` ranges;
* names (`MAX_NAME_CHARS`, `validate.NAME_RE`) and integers (`MAX_INT`): the same
  checks on both sides.

(`MAX_POLICY_DOMAINS` must not exceed `MAX_DOMAINS`: tests/test_commit_rules.py.)
"""

from __future__ import annotations

MAX_INT = 2**63 - 1
"""Epochs, versions, incarnations, generations and sizes: non-negative int64."""
MAX_NAME_CHARS = 128
"""Node ids, stream names and domain names (`validate.NAME_RE`)."""
MAX_RANGES = 4096
"""Ranges in one interval set of a record (GC keeps real sets far smaller)."""
MAX_DOMAINS = 64
"""``newest`` entries (domains) in one record."""
MAX_GENERATIONS = 16
"""Frozen sets of open recovery generations in one record, and open here."""
MAX_MEMBERS = 4096
"""Members of one stream (``limits.max_members`` may only lower it)."""
MAX_RANKS_PER_MEMBER = 4096
"""Ranks one member of a stream hosts."""
MAX_POLICY_DOMAINS = 16
"""Domains one policy names: each may appear in the record's ``newest``."""
MAX_DIGEST_CHARS = 256
"""A commit's digest, ``ALGO:hex`` (kept in the log, never in a record)."""
