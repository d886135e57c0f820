"""Background verification of the checkpoints a node's ranks committed
(`verifier.Verifier`), and its configuration (`config`)."""
