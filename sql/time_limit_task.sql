-- keyexpiry ledger for MySQL 8 / MariaDB 10.6+. Equivalent to `keyexpiry init-db`
-- (keyexpiry/store.py); tests/test_ddl.py creates the table from this file and uses it through
-- the model, so the two cannot drift apart.
--
-- Times are epoch milliseconds on Redis's clock (the one clock keyexpiry uses for due times).
-- task_key is pure printable ASCII (arguments are percent-escaped), so ascii_bin gives a
-- case-sensitive unique key that fits InnoDB's index size limit at 512 bytes.
--
-- Upgrading a table created before the last three indexes (keyexpiry init-db does this, online):
--   ALTER TABLE time_limit_task
--     ADD INDEX ix_time_limit_task_status_due_key (status, due_at_ms, task_key, attempts),
--     ADD INDEX ix_time_limit_task_status_attempts (status, attempts, due_at_ms),
--     ADD INDEX ix_time_limit_task_status_finished (status, finished_at_ms, class_name);
--
-- Dropping the two indexes no query uses any more, once every listener runs this version and the
-- indexes above exist (keyexpiry init-db does this):
--   ALTER TABLE time_limit_task
--     DROP INDEX ix_time_limit_task_status_due,
--     DROP INDEX ix_time_limit_task_claimed_by;
--
-- Upgrading a table created before payload and traceparent (keyexpiry init-db does this):
--   ALTER TABLE time_limit_task ADD COLUMN payload MEDIUMTEXT NULL,
--                               ADD COLUMN traceparent VARCHAR(55) NULL;
--
-- Upgrading a table created before tag and result (keyexpiry init-db does this):
--   ALTER TABLE time_limit_task
--       ADD COLUMN tag VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
--       ADD COLUMN result MEDIUMTEXT NULL,
--       ADD INDEX ix_time_limit_task_tag (tag, due_at_ms);
--
-- Upgrading a table created before recurring schedules (keyexpiry init-db does this, and creates
-- keyexpiry_schedule: sql/keyexpiry_schedule.sql):
--   ALTER TABLE time_limit_task
--       ADD COLUMN schedule_name VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL;
CREATE TABLE IF NOT EXISTS time_limit_task (
    id               BIGINT       NOT NULL AUTO_INCREMENT,
    task_key         VARCHAR(512) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    class_name       VARCHAR(128) NOT NULL,
    method           VARCHAR(128) NOT NULL,
    args             MEDIUMTEXT   NOT NULL,            -- JSON list of argument strings
    status           VARCHAR(16)  NOT NULL,            -- pending, running, done, dead, cancelled
    attempts         INTEGER      NOT NULL,            -- runs claimed so far
    retry_schedule_s TEXT         NULL,                -- JSON list overriding the retry delays
    due_at_ms        BIGINT       NOT NULL,
    created_at_ms    BIGINT       NOT NULL,
    updated_at_ms    BIGINT       NOT NULL,
    started_at_ms    BIGINT       NULL,
    finished_at_ms   BIGINT       NULL,
    claimed_by       VARCHAR(96)  NULL,                -- listener and claim batch that ran it
    lease_until_ms   BIGINT       NULL,                -- a running row past this is re-run
    last_error       MEDIUMTEXT   NULL,
    tag              VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,  -- business key
    result           MEDIUMTEXT   NULL,                -- the handler's return value, JSON
    payload          MEDIUMTEXT   NULL,                -- what travels with the task, JSON
    traceparent      VARCHAR(55)  NULL,                -- W3C traceparent of the creating span
    -- the schedule whose occurrence the row is (keyexpiry_schedule.name); NULL: a plain task,
    -- what producers write (they leave the column out)
    schedule_name    VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    PRIMARY KEY (id),
    CONSTRAINT uq_time_limit_task_key UNIQUE (task_key),
    -- the listener claims by key; running rows by lease (and a dead listener's among them)
    INDEX ix_time_limit_task_status_lease (status, lease_until_ms),
    -- every read of one status in due order; reconciliation's walk over pending keys reads
    -- this index alone (no row lookups)
    INDEX ix_time_limit_task_status_due_key (status, due_at_ms, task_key, attempts),
    -- the dashboard's retrying list (pending rows that failed at least once)
    INDEX ix_time_limit_task_status_attempts (status, attempts, due_at_ms),
    -- retention and the dead-task counts: finished rows by finish time and class
    INDEX ix_time_limit_task_status_finished (status, finished_at_ms, class_name),
    -- list and cancel by tag
    INDEX ix_time_limit_task_tag (tag, due_at_ms)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
