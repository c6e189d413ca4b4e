"""Data loaders: downloads with a cache and sha256 verification, and the offline fallbacks."""
