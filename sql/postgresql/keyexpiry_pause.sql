-- Task classes and methods paused fleet-wide (PostgreSQL): one row per `Class` (every method of
-- it) or `Class.method`, read by every listener each second. Equivalent to `keyexpiry init-db`;
-- sql/keyexpiry_pause.sql is the MySQL form and says more. By hand:
--   INSERT INTO keyexpiry_pause (target, until_ms, paused_at_ms, reason)
--   VALUES ('OrderTimeout.close_unpaid', NULL, 1767225600000, 'payment provider down')
--   ON CONFLICT (target) DO UPDATE SET until_ms = EXCLUDED.until_ms,
--       paused_at_ms = EXCLUDED.paused_at_ms, reason = EXCLUDED.reason;
CREATE TABLE IF NOT EXISTS keyexpiry_pause (
    target       VARCHAR(257) COLLATE "C" NOT NULL,   -- case-sensitive, as in Python
    until_ms     BIGINT       NULL,       -- when the pause ends; NULL: until resumed
    paused_at_ms BIGINT       NOT NULL,   -- when it was (last) paused
    reason       VARCHAR(255) NULL,       -- what the operator said
    PRIMARY KEY (target)
);
