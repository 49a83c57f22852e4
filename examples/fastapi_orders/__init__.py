"""A FastAPI shop whose unpaid orders close themselves: see README.md beside this file."""
