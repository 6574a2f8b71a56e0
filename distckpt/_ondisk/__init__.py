"""The on-disk format: names, the manifest schema, xxh3-128 hashes, and the non-tensor values a
checkpoint may hold."""
