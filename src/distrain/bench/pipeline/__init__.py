"""``distrain bench pipeline``: bubbles.py measures the pipeline bubble of each schedule on
synthetic stages against its formula."""
