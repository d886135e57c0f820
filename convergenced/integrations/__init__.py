"""What a training job calls: checkpointing that commits to the local daemon for you.

- `convergenced.integrations.files`: framework-free, epoch-aware checkpoints of bytes
  on two tiers (a fast local domain and a slower remote one filled by a background
  uploader), restore from the agreed restore point, and garbage collection of exactly
  what the daemon says is safe.
- `convergenced.integrations.shards`: the shard file those checkpoints are made of
  (format, verification, where it lives in a tier, assembling one epoch's shards).
- `convergenced.integrations.errors`: their errors, one hierarchy under
  `CheckpointError`.
- `convergenced.integrations.launches`: the recovery generation of a launch, and the
  membership its ranks declare when the hosts changed (a spare, fewer or more hosts),
  asked by one rank and shared with the others (over a torch process group, or your
  own way).
- `convergenced.integrations.uploads`: the store's background uploader.
- `convergenced.integrations.objectstore`: an S3 bucket as a store's tier (AWS, MinIO,
  Ceph), through s3fs, configured by the standard AWS environment.
- `convergenced.integrations.dcp`: PyTorch Distributed Checkpoint (``dcp.save``,
  ``dcp.async_save``, ``dcp.load``) committed once each step is loadable, loads of the
  agreed step (resharded to another world size as DCP allows), and GC;
  `convergenced.integrations.dcp_layout` says whether a step directory is complete for
  the world that saved it.
- `convergenced.integrations.torch`: PyTorch state (model, optimizer, scheduler, RNG)
  on those checkpoints.
- `convergenced.integrations.torchtitan`: torchtitan's checkpoint manager, loading the
  agreed step, committing its DCP saves and purging only what the daemon says is safe.
- `convergenced.integrations.drain`: whether a drain of this node asks the job for a
  checkpoint now, for the training loop to save at once.

Integrations never import a training framework unless it is used.
"""

from __future__ import annotations
