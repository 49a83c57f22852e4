-- keyexpiry's recurring schedules for MySQL 8 / MariaDB 10.6+. Equivalent to `keyexpiry init-db`
-- (keyexpiry/ledger/table.py), which also creates it in an existing ledger database (as does
-- every client and listener start); tests/test_ddl.py creates it from this file and compares it
-- with the model.
--
-- keyexpiry writes this table, producers do not: `Client.schedule` (and the listeners, for the
-- `@exposed(cron=...)` methods they register) declares a schedule, `keyexpiry schedule
-- pause|resume|remove|run-now` operates it, and each run's outcome moves it on. A schedule has
-- one row in time_limit_task at a time, its next occurrence: an ordinary task with the key
-- task_key, marked with the schedule's name in time_limit_task.schedule_name. Times are epoch ms
-- on Redis's clock. Read it with `keyexpiry schedules` (or SELECT: nothing here is secret).
CREATE TABLE IF NOT EXISTS keyexpiry_schedule (
    -- printable text without spaces, compared byte for byte
    name                  VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    task_key              VARCHAR(512) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    class_name            VARCHAR(128) NOT NULL,
    method                VARCHAR(128) NOT NULL,
    args                  MEDIUMTEXT   NOT NULL,       -- JSON list of argument strings
    -- when: a cron expression in tz, or every every_ms from start_ms (else anchor_ms)
    cron                  VARCHAR(200) NULL,
    every_ms              BIGINT       NULL,
    tz                    VARCHAR(64)  NOT NULL,       -- IANA time zone of the cron expression
    start_ms              BIGINT       NULL,           -- no occurrence before this
    end_ms                BIGINT       NULL,           -- no occurrence after this
    anchor_ms             BIGINT       NOT NULL,       -- the first declaration's time
    catch_up              VARCHAR(8)   NOT NULL,       -- latest, all, none
    catch_up_max          INTEGER      NOT NULL,
    overlap               VARCHAR(8)   NOT NULL,       -- skip, wait
    retry_schedule_s      TEXT         NULL,           -- JSON list overriding the retry delays
    paused                INTEGER      NOT NULL,       -- 1 while paused
    occurrence_ms         BIGINT       NULL,           -- the occurrence its task row stands for;
                                                       -- NULL: the schedule has ended
    last_scheduled_for_ms BIGINT       NULL,           -- the occurrence the last run stood for
    last_status           VARCHAR(16)  NULL,           -- done, dead, skipped
    last_finished_ms      BIGINT       NULL,
    last_success_ms       BIGINT       NULL,           -- when a run last ended done
    last_error            MEDIUMTEXT   NULL,
    source                VARCHAR(8)   NOT NULL,       -- code (@exposed(cron=...)) or api
    created_at_ms         BIGINT       NOT NULL,
    updated_at_ms         BIGINT       NOT NULL,
    PRIMARY KEY (name),
    -- a task has one schedule
    CONSTRAINT uq_keyexpiry_schedule_task_key UNIQUE (task_key)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
