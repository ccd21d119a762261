//! kvgate end-to-end tests and the demo driver live here; see `tests/` and `src/bin/`.
