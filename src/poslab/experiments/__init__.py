"""Reproduction recipes (one file each) and the runner/report that turn them into report.md."""
from poslab.experiments.runner import RECIPES, RecipeResult, reproduce

__all__ = ["RECIPES", "RecipeResult", "reproduce"]
