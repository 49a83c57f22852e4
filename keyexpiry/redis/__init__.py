"""Redis: the embedded server, Cluster and Sentinel clients, what a server must offer, and arming
task keys."""
