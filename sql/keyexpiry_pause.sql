-- keyexpiry's paused task classes and methods for MySQL 8 / MariaDB 10.6+. Equivalent to
-- `keyexpiry init-db` (keyexpiry/ledger/table.py), which also creates it in an existing ledger
-- database (as does every client and listener start); tests/test_ddl.py creates it from this
-- file and compares it with the model.
--
-- One row per paused target: `Class` (every method of it) or `Class.method`. Listeners read the
-- table every second (and at once when a pause or resume publishes `#keyexpiry#pause` on the
-- wake channel) and hold the paused tasks back: pending, run once the pause ends. A row whose
-- until_ms has passed is no pause; a listener deletes it. Times are epoch ms on Redis's clock.
-- `keyexpiry pause`, `resume` and `paused` (or Client.pause/resume/paused) write and read it;
-- by hand:
--   INSERT INTO keyexpiry_pause (target, until_ms, paused_at_ms, reason)
--   VALUES ('OrderTimeout.close_unpaid', NULL, 1767225600000, 'payment provider down')
--   ON DUPLICATE KEY UPDATE until_ms = VALUES(until_ms), paused_at_ms = VALUES(paused_at_ms),
--                           reason = VALUES(reason);
CREATE TABLE IF NOT EXISTS keyexpiry_pause (
    -- class and method names are ASCII identifiers, case-sensitive as in Python
    target       VARCHAR(257) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    until_ms     BIGINT       NULL,                 -- when the pause ends; NULL: until resumed
    paused_at_ms BIGINT       NOT NULL,             -- when it was (last) paused
    reason       VARCHAR(255) NULL,                 -- what the operator said
    PRIMARY KEY (target)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
