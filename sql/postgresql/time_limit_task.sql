-- keyexpiry ledger for PostgreSQL 13+. Equivalent to `keyexpiry init-db` (keyexpiry/ledger/table.py);
-- tests/test_ddl.py creates the table from this file and compares it with the model's, so the
-- two cannot drift apart. sql/time_limit_task.sql is the same table for MySQL/MariaDB.
--
-- Times are epoch milliseconds on Redis's clock (the one clock keyexpiry uses for due times).
-- task_key is pure printable ASCII (arguments are percent-escaped); COLLATE "C" compares bytes
-- (case-sensitive, as on MySQL's ascii_bin) and lets the unique index serve a class's keys as a
-- `LIKE 'Class@%'` range whatever the database's locale. Tags compare byte for byte the same way.
--
-- Upgrading a table created before recurring schedules (keyexpiry init-db does this, and creates
-- keyexpiry_schedule: sql/postgresql/keyexpiry_schedule.sql):
--   ALTER TABLE time_limit_task ADD COLUMN schedule_name VARCHAR(200) COLLATE "C" NULL;
--
-- Run it in the database the ledger URL names, as a role that owns the tables (or has SELECT,
-- INSERT, UPDATE, DELETE on them and USAGE on the id sequence).
CREATE TABLE IF NOT EXISTS time_limit_task (
    id               BIGSERIAL    NOT NULL,
    task_key         VARCHAR(512) COLLATE "C" NOT NULL,
    class_name       VARCHAR(128) NOT NULL,
    method           VARCHAR(128) NOT NULL,
    args             TEXT         NOT NULL,            -- JSON list of argument strings
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
    last_error       TEXT         NULL,
    tag              VARCHAR(128) COLLATE "C" NULL,    -- business key
    result           TEXT         NULL,                -- the handler's return value, JSON
    payload          TEXT         NULL,                -- what travels with the task, JSON
    traceparent      VARCHAR(55)  NULL,                -- W3C traceparent of the creating span
    -- the schedule whose occurrence the row is (keyexpiry_schedule.name); NULL: a plain task,
    -- what producers write (they leave the column out)
    schedule_name    VARCHAR(200) COLLATE "C" NULL,
    PRIMARY KEY (id),
    CONSTRAINT uq_time_limit_task_key UNIQUE (task_key)
);
-- the listener claims by key; running rows by lease (and a dead listener's among them)
CREATE INDEX IF NOT EXISTS ix_time_limit_task_status_lease
    ON time_limit_task (status, lease_until_ms);
-- every read of one status in due order; reconciliation's walk over pending keys reads this
-- index alone (an index-only scan where the visibility map allows)
CREATE INDEX IF NOT EXISTS ix_time_limit_task_status_due_key
    ON time_limit_task (status, due_at_ms, task_key, attempts);
-- the dashboard's retrying list: pending rows that failed, a partial index of them alone (MySQL
-- has ix_time_limit_task_status_attempts instead, which PostgreSQL's planner misuses)
CREATE INDEX IF NOT EXISTS ix_time_limit_task_retrying
    ON time_limit_task (due_at_ms, task_key) WHERE status = 'pending' AND attempts > 0;
-- retention and the dead-task counts: finished rows by finish time (and class), index-only
-- with the id included
CREATE INDEX IF NOT EXISTS ix_time_limit_task_status_finished
    ON time_limit_task (status, finished_at_ms, class_name) INCLUDE (id);
-- a tag's rows by due time
CREATE INDEX IF NOT EXISTS ix_time_limit_task_tag
    ON time_limit_task (tag, due_at_ms);
