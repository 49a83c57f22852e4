"""Runnable examples of keyexpiry inside web frameworks (not shipped in the wheel)."""
