"""The run: the job a user gives (`job`, read from flat fields by `job_fields`), its data
(`job_data`), its store references (`stores`), its validation into a `ResolvedJob` (`validate`), the run's context and state
(`context`), resume from the store (`resume`), the outer optimizer's defaults (`outer_step`)
and Prefect's retry rules (`retry`). The lowest room of the coordinator: it imports no other."""
