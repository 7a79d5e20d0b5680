"""The bill: the ledger's records and their prices (`cost`), the cloud's own clock for
workers the coordinator did not time (`cloud_bill`), and the bill now, written to the run's
store (`ledger`). Imports the run only; never the report."""
