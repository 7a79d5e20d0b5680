"""The workers: one epoch's specs (`worker_specs`) and data (`staging`), launching them
(`launchers`, `worker_forks`) or keeping them warm (`warm_pool`, `warm_prestart`), one epoch
run over them (`epoch_run`), their failures (`failures`), and what is given back: sweeps,
cleanup, checkpoint retention. Imports the run and the bill."""
