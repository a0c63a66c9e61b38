"""Benchmarks (installed as yggdrasil.bench): every one is a `yggdrasil bench SUITE` (suites.py
lists them; run.py runs them). Every suite prints a table and ends with one JSON line."""
