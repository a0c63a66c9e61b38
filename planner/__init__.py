"""Stage planner (docs/design.md §3.5): the stage DAG of speculative iterations, ahead-of-time moves,
and the offline search for the fastest execution plan per bucket."""
