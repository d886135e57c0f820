"""Markers for unmodified frameworks: ``convergenced marker``.

DeepSpeed, Megatron-LM and PyTorch DCP jobs that do not call convergenced at all
still get checkpoints every rank can restore: a marker process beside the job on each
node commits each step once it is complete in the framework's own format, and keeps
the framework's "latest" file on the restore point the daemons agreed on.

- `convergenced.markers.layouts`: each framework's step directories, the files each
  rank needs, and its "latest" file;
- `convergenced.markers.verify`: whether a file is finished (settled, whole), and its
  digest;
- `convergenced.markers.marker`: the `Marker` itself, one pass at a time;
- `convergenced.markers.command`: ``convergenced marker``'s options and loop.

See docs/markers.md.
"""

from __future__ import annotations
