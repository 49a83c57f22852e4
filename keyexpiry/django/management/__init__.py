"""`manage.py keyexpiry …`: the keyexpiry command with settings.py's settings."""
