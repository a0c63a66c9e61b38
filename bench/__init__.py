"""Benchmarks (installed as yggdrasil.bench): `yggdrasil bench SUITE` runs the evaluation suites
(compare, ablation, trees, sensitivity); the scripts here (decode.py, spec.py, bundle.py, ...)
measure single subsystems. Every benchmark prints a table and ends with one JSON line."""
