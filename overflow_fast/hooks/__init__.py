"""The hook layer: the detector's face, its hooks, and what they decide."""
