"""Durability: the write-ahead log file (`log_file`, with its entries in `entries`)
and the group commit that makes facts durable before the output gate lets anything
that reveals them leave (`group_commit`)."""
