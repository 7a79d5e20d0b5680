"""What every benchmark script shares, so that a script holds only what it measures.

Each script imports this harness, `benchmarks.output` (its results file's header) and the project,
never another script:

- `home`: `REPO` and `scratch`, the temporary folder (or Zooid home) a benchmark works in;
- `train`: the train command (`python -m flows.train`) with the one parameter encoding
  `make run` uses (`--param NAME=VALUE`), and the small digits job several scripts run;
- `stack`: a local stack for the block, and `train/local` runs on it read back from the store;
- `overhead`: per-epoch wall, busy and overhead from a run's summary;
- `replicas`: Local-SGD replicas as threads of this process (`train_replicas`, `Trace`);
- `servers`: Redis and S3 (moto) servers on free ports, stopped by pid;
- `workers`: the instrumented worker processes that stamp the engine's loop points;
- `tables`: `median`, value formats, markdown tables, and results files kept in parts.

Store keys come from `core.keys`; no module under benchmarks/ spells `runs/`. A script may keep
parts of itself in modules that no other script imports (`bench_language_models`: parts a and b
in `lm_sync.py` and `lm_plain.py`); models and datasets that workers import by path
(`prediction_models.py`, `lm_shapes.py`) are imported by no script.
"""
