"""Recurring schedules: `rules` (cron and intervals in a zone, catch-up and overlap, the plan of
a run) and `operate` (declaring them, restoring a lost occurrence, who registers their class).
Their rows are `keyexpiry.ledger.recurring`'s."""
