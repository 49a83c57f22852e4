"""A tiny Django app the keyexpiry.django tests install: an order model and task functions."""
