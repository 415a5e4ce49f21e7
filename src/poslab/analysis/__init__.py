"""Measurements on models and their activations: capture, similarity/adjacency, variance, probes,
spectra, head taxonomy, attention distances, frequency usage, length extrapolation, plots.

Only the similarity functions are imported here: ``poslab.functional`` re-exports them, so this
package must import nothing heavy (models, matplotlib) at import time. Import the other modules by name.
"""
from poslab.analysis.similarity import adjacency_score, cosine_self_similarity

__all__ = ["adjacency_score", "cosine_self_similarity"]
