"""The runtime: a speculator over a deployed target and draft - step graphs and their dispatcher,
drafters, token trees, the stage plans, and the generation loop (docs/design.md §2). It reads
models (yggdrasil.models) and bundle storage (yggdrasil.storage), never compile, bench or graphs."""
