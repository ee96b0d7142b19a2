"""The study tools: several methods on one preset and their report, the law fit, plots, and the built-in base model."""
