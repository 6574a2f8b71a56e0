"""The fast reader: large sequential reads straight into destination tensors, hashes from the
bytes read."""
