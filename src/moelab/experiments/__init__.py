"""Experiment runners behind the ``moelab`` subcommands (specialization.py: Krishnamurthy et al. (2023))."""
