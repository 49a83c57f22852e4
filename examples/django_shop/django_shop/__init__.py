"""A Django shop on keyexpiry: an order closed unless paid in 15 minutes, a daily report."""
