-- keyexpiry's recurring schedules (PostgreSQL). Equivalent to `keyexpiry init-db`;
-- sql/keyexpiry_schedule.sql is the MySQL form and says more. keyexpiry writes this table
-- (`Client.schedule`, listeners, `keyexpiry schedule ...`), producers do not: each schedule's next
-- occurrence is an ordinary row of time_limit_task whose schedule_name is the schedule's name.
CREATE TABLE IF NOT EXISTS keyexpiry_schedule (
    name                  VARCHAR(200) COLLATE "C" NOT NULL,  -- compared byte for byte
    task_key              VARCHAR(512) COLLATE "C" NOT NULL,
    class_name            VARCHAR(128) NOT NULL,
    method                VARCHAR(128) NOT NULL,
    args                  TEXT         NOT NULL,       -- JSON list of argument strings
    cron                  VARCHAR(200) NULL,           -- a cron expression in tz, or ...
    every_ms              BIGINT       NULL,           -- ... an interval from start_ms/anchor_ms
    tz                    VARCHAR(64)  NOT NULL,
    start_ms              BIGINT       NULL,
    end_ms                BIGINT       NULL,
    anchor_ms             BIGINT       NOT NULL,
    catch_up              VARCHAR(8)   NOT NULL,       -- latest, all, none
    catch_up_max          INTEGER      NOT NULL,
    overlap               VARCHAR(8)   NOT NULL,       -- skip, wait
    retry_schedule_s      TEXT         NULL,
    paused                INTEGER      NOT NULL,       -- 1 while paused
    occurrence_ms         BIGINT       NULL,           -- NULL: the schedule has ended
    last_scheduled_for_ms BIGINT       NULL,
    last_status           VARCHAR(16)  NULL,           -- done, dead, skipped
    last_finished_ms      BIGINT       NULL,
    last_success_ms       BIGINT       NULL,
    last_error            TEXT         NULL,
    source                VARCHAR(8)   NOT NULL,       -- code or api
    created_at_ms         BIGINT       NOT NULL,
    updated_at_ms         BIGINT       NOT NULL,
    PRIMARY KEY (name),
    CONSTRAINT uq_keyexpiry_schedule_task_key UNIQUE (task_key)
);
