"""Orders: placed unpaid, closed by a task unless paid within 15 minutes."""
