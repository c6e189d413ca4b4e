"""Models built on the core layer: CNN experts and gates of Krishnamurthy et al. (2023) (vision.py), the language models of CompeteSMoE (2024) (lm.py, classifier.py)."""
