"""One save end to end: the transaction, retention and its deletions, incremental saves, and the
policy pieces that decide when to save (schedule, preemption, grace window)."""
