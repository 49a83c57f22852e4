"""Example business tasks for keyexpiry, on a small demo schema (see tasks/schema.py)."""
