"""One load end to end: which checkpoint (discovery), whether a start is a restart, the resume
checks (run id, loss probe) and the load itself."""
