-- Live listeners of the fleet and their last heartbeat (PostgreSQL); a silent one's runs are
-- taken over. Equivalent to `keyexpiry init-db`; sql/keyexpiry_listener.sql is the MySQL form.
CREATE TABLE IF NOT EXISTS keyexpiry_listener (
    id              VARCHAR(96)  NOT NULL,   -- host:pid:random, as in time_limit_task.claimed_by
    host            VARCHAR(255) NOT NULL,
    pid             INTEGER      NOT NULL,
    started_at_ms   BIGINT       NOT NULL,
    heartbeat_at_ms BIGINT       NOT NULL,
    running         INTEGER      NOT NULL,   -- runs in flight at the last heartbeat
    stopping_at_ms  BIGINT       NULL,       -- when it began a graceful stop
    classes         TEXT         NULL,       -- its registered task classes, comma-separated
    PRIMARY KEY (id)
);
CREATE INDEX IF NOT EXISTS ix_keyexpiry_listener_heartbeat
    ON keyexpiry_listener (heartbeat_at_ms);
