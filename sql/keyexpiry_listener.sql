-- keyexpiry's live listeners for MySQL 8 / MariaDB 10.6+. Equivalent to `keyexpiry init-db`
-- (keyexpiry/table.py), which also creates it in an existing ledger database; tests/test_ddl.py
-- creates it from this file and compares it with the model.
--
-- Each listener writes its row every heartbeat_s (1 s) and deletes it when it stops; a row older
-- than takeover_after_s (5 s) is a listener that died: another one requeues its running tasks
-- (claimed_by = id + ':' + batch) and deletes the row. Times are epoch ms on Redis's clock.
-- Live listeners share the task keys by class and hash bucket (keyexpiry/partition.py): a
-- listener hears every expired event but claims only its share.
--
-- Upgrading a table created before stopping_at_ms and classes (keyexpiry init-db does this):
--   ALTER TABLE keyexpiry_listener ADD COLUMN stopping_at_ms BIGINT NULL,
--                                  ADD COLUMN classes TEXT NULL;
CREATE TABLE IF NOT EXISTS keyexpiry_listener (
    id              VARCHAR(96)  NOT NULL,             -- host:pid:random, as in claimed_by
    host            VARCHAR(255) NOT NULL,
    pid             INTEGER      NOT NULL,
    started_at_ms   BIGINT       NOT NULL,
    heartbeat_at_ms BIGINT       NOT NULL,
    running         INTEGER      NOT NULL,             -- runs claimed and not yet finished
    stopping_at_ms  BIGINT       NULL,                 -- began a graceful stop (peers take its keys)
    classes         TEXT         NULL,                 -- its task classes, comma-separated
    PRIMARY KEY (id),
    INDEX ix_keyexpiry_listener_heartbeat (heartbeat_at_ms)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
