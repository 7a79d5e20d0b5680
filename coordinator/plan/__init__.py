"""The plan: the profile on the target (`target_profile`, cached by `profile_cache`), the
run's fixed terms (`run_terms`), planning and re-planning (`planning`, with the exact
co-optimiser's adapter `co_plan`) and the scaling policy (`scaling_policy`). Imports the run,
the bill and the workers (a profile is taken on a worker)."""
