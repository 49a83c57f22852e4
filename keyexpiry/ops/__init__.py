"""What operators watch: Prometheus metrics, the `--http` endpoints, `keyexpiry doctor`'s checks."""
