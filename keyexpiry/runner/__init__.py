"""Claim, run, record: the claimer, the runs in flight, the workers and the event loop of async
handlers, transactional handlers, the recorder."""
