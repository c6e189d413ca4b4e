"""Experiment runners behind the ``moelab`` subcommands (specialization.py: paper 002)."""
