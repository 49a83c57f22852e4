"""The ledger: the `time_limit_task` table and its rows, upgrades in place, the transaction every
query runs in, and the query families of the Store."""
