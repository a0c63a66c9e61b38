"""Measuring and predicting: device profiles, latency cost models (imported as yggdrasil.predictor)."""
