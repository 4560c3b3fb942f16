"""Tracking: MLflow runs, the model registry, the champion/challenger gate, comparisons."""
