"""The expost HTTP service: filter + ledger in the database, mechanisms from ``mechanisms``."""
