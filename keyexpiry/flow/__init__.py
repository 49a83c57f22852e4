"""Flow control: `rules` (concurrency, rate and one-at-a-time, as `@exposed` declares them) and
`pauses` (holding a class or method back, and the wake that tells listeners). Their parts on the
data path: `redis.permits` (fleet-wide permits), `ledger.pauses` (the pause rows) and
`runner.gate` (what a claim may start)."""
