"""Models built on the core layer: CNN experts and gates of paper 002 (vision.py)."""
