<?php

/**
 * A keyexpiry producer for PHP: creates, reschedules and cancels delayed tasks exactly as
 * docs/PROTOCOL.md says (one row in `time_limit_task`, then one Redis key that expires at the
 * task's due time); a Python keyexpiry listener runs them.
 *
 * One file, no framework: PDO (pdo_mysql for a MySQL/MariaDB ledger, pdo_pgsql for a PostgreSQL
 * one) and phpredis, as Debian's php-cli, php-mysql or php-pgsql, and php-redis install them.
 * PHP 8.2. See README.md next to this file.
 */

declare(strict_types=1);

namespace Keyexpiry;

/** A task name, argument, time, tag, retry schedule or payload that the protocol refuses. */
class ArgumentError extends \InvalidArgumentException
{
}

final class Producer
{
    /** The ledger table (docs/PROTOCOL.md, sql/time_limit_task.sql). */
    public const TABLE = 'time_limit_task';
    /** Longest key in bytes, prefix included (the ledger's unique index is sized for it). */
    public const MAX_KEY_BYTES = 512;
    /** Longest key prefix, in characters (the listeners' KEYEXPIRY_KEY_PREFIX). */
    public const MAX_PREFIX_CHARS = 64;
    /** Longest tag, in characters. */
    public const MAX_TAG_CHARS = 128;
    /** At most this many retries in a retry schedule, ... */
    public const MAX_RETRIES = 100;
    /** ... each at most this many seconds (a year). */
    public const MAX_RETRY_DELAY_S = 31_536_000;
    /** Due times reach at most this far ahead (100 years), as keyexpiry's Python client. */
    public const MAX_HORIZON_MS = 100 * 365 * 86_400 * 1000;
    /** What `Decimal` text may hold at most (digits and exponent), as keyexpiry. */
    private const MAX_DECIMAL_DIGITS = 600;
    /** Deepest nesting of arrays and objects in a payload, as keyexpiry (limits.MAX_JSON_DEPTH). */
    public const MAX_JSON_DEPTH = 64;

    private const NAME = '/^[A-Za-z][A-Za-z0-9_]*$/D';

    private ?bool $rowAlias;
    /** The ledger's SQL: PROTOCOL.md's PostgreSQL create, else its MySQL one. */
    private readonly bool $postgres;
    private bool $charsetChecked = false;
    /** @var list<array{string, string, int}> keys to arm ('set', key, due) or delete ('del') after COMMIT */
    private array $afterCommit = [];
    private ?int $lastDueAtMs = null;
    private ?string $lastOutcome = null;

    /**
     * @param \PDO   $pdo    a connection to the listeners' ledger: MySQL/MariaDB (pdo_mysql), its
     *                       DSN saying `charset=utf8mb4`, or PostgreSQL (pdo_pgsql), its
     *                       client_encoding UTF8. Errors are thrown whatever its ATTR_ERRMODE.
     * @param \Redis $redis  connected to the listeners' Redis, with their database selected
     *                       (the number in their KEYEXPIRY_REDIS_URL).
     * @param string $prefix the listeners' KEYEXPIRY_KEY_PREFIX ('' by default).
     * @param int    $wakeAheadMs  the listeners' KEYEXPIRY_WAKE_AHEAD_S, in ms: a task due within
     *                       it is announced on the wake channel.
     * @param int    $payloadMaxBytes the listeners' KEYEXPIRY_PAYLOAD_MAX_BYTES.
     * @param ?bool  $rowAlias the MySQL 8.0.20+ form of the create (`AS new` instead of
     *                       `VALUES()`); null: decided from the server's version. Unused on
     *                       PostgreSQL.
     * @throws \LogicException for a PDO of another driver than mysql or pgsql.
     */
    public function __construct(
        private readonly \PDO $pdo,
        private readonly \Redis $redis,
        private readonly string $prefix = '',
        private readonly int $wakeAheadMs = 120_000,
        private readonly int $payloadMaxBytes = 65_536,
        ?bool $rowAlias = null,
    ) {
        self::checkPrefix($prefix);
        $this->rowAlias = $rowAlias;
        $driver = (string) $pdo->getAttribute(\PDO::ATTR_DRIVER_NAME);
        if ($driver !== 'mysql' && $driver !== 'pgsql') {
            throw new \LogicException(
                "the ledger is MySQL/MariaDB (pdo_mysql) or PostgreSQL (pdo_pgsql); this PDO's driver is $driver"
            );
        }
        $this->postgres = $driver === 'pgsql';
    }

    // --- keys ----------------------------------------------------------------------------------

    /** The Redis key of `$task` ("Class.method") with `$args`: `{prefix}Class@method@arg…`. */
    public function key(string $task, array $args): string
    {
        return self::keyFor($task, $args, $this->prefix);
    }

    /** As `key`, without a producer (no connections needed). */
    public static function keyFor(string $task, array $args, string $prefix = ''): string
    {
        [$class, $method] = self::splitTask($task);
        $key = self::checkPrefix($prefix) . $class . '@' . $method;
        foreach (self::argTexts($args) as $text) {
            $key .= '@' . self::escape($text);
        }
        if (strlen($key) > self::MAX_KEY_BYTES) {
            throw new ArgumentError(
                'task key would be ' . strlen($key) . ' bytes; the limit is ' . self::MAX_KEY_BYTES
                . ' (pass the id of a row in your own table rather than large data)'
            );
        }
        return $key;
    }

    /**
     * One argument's canonical text (docs/PROTOCOL.md): an int in decimal, a bool as
     * true/false, a float as Python's repr (0.5, 5.0, 1e+100; -0.0 as 0.0), a string as it is
     * (valid UTF-8). Anything else (null, arrays, objects, NaN, infinities) is refused.
     * For a `Decimal` parameter pass `Producer::decimal(...)`, for a `UUID` its lower-case
     * hyphenated text, for a `date` `$d->format('Y-m-d')`.
     */
    public static function argText(mixed $value): string
    {
        if (is_bool($value)) {
            return $value ? 'true' : 'false';
        }
        if (is_int($value)) {
            return (string) $value;
        }
        if (is_float($value)) {
            return self::floatText($value);
        }
        if (is_string($value)) {
            if (!self::isUtf8($value)) {
                throw new ArgumentError('a string argument must be valid UTF-8');
            }
            return $value;
        }
        throw new ArgumentError(
            'an argument must be an int, float, bool or string, got ' . get_debug_type($value)
        );
    }

    /** Percent-escape one canonical text for the key (docs/PROTOCOL.md's PHP snippet). */
    public static function escape(string $arg): string
    {
        return preg_replace_callback(
            '/[^A-Za-z0-9!#$&\'()*+,\-.\/:;<=>?\[\]^_`|~]/',
            fn ($m) => sprintf('%%%02X', ord($m[0])),
            $arg
        );
    }

    /**
     * The canonical text of a decimal number (for a `Decimal` parameter): plain notation, no
     * exponent, no trailing zeros after the point, `0` never `-0` ("19.90" → "19.9",
     * "2E+1" → "20"). Pass a string (or an int), never a float.
     */
    public static function decimal(string|int $value): string
    {
        $text = (string) $value;
        if (!preg_match('/^([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?$/D', $text, $m)
            || ($m[2] ?? '') . ($m[3] ?? '') === ''
        ) {
            throw new ArgumentError('not a decimal number: ' . self::shown($text));
        }
        $fraction = $m[3] ?? '';
        $exponent = $m[4] ?? '';
        if (strlen(ltrim($exponent, '+-0')) > 9) {
            throw new ArgumentError('the decimal has too many digits for a task key');
        }
        $digits = ltrim($m[2] . $fraction, '0');
        $exp = (int) $exponent - strlen($fraction);
        // Counted as Python's Decimal counts them (zero has one digit), before anything is cut.
        if (max(strlen($digits), 1) + abs($exp) > self::MAX_DECIMAL_DIGITS) {
            throw new ArgumentError('the decimal has too many digits for a task key');
        }
        if ($digits === '') {
            return '0';
        }
        while ($exp < 0 && str_ends_with($digits, '0')) {
            $digits = substr($digits, 0, -1);
            $exp++;
        }
        if ($exp >= 0) {
            $plain = $digits . str_repeat('0', $exp);
        } else {
            $point = strlen($digits) + $exp;
            $plain = $point > 0
                ? substr($digits, 0, $point) . '.' . substr($digits, $point)
                : '0.' . str_repeat('0', -$point) . $digits;
        }
        return ($m[1] === '-' ? '-' : '') . $plain;
    }

    // --- create --------------------------------------------------------------------------------

    /**
     * Create `$task` ("Class.method") with `$args`, due in `$ttlMs` milliseconds on Redis's
     * clock; return its key. A key that exists already is rescheduled, whatever its status
     * (arguments, schedule and times replaced, attempts back to 0): it runs once, at or after
     * the new due time.
     *
     * `$tag`: a business key (1 to 128 characters); null keeps the tag an existing row has.
     * `$retrySchedule`: seconds before each retry (`[15, 60, 300]`, `[]`: none); null: the
     * method's, else the listeners' schedule. `$payload`: any JSON-encodable value that travels
     * with the task in its row (the handler's `current().payload`); null keeps the payload an
     * existing row has (and writes no payload column, so a ledger without one works too).
     *
     * Inside a PDO transaction the row is written in it and the key is set by `afterCommit()`,
     * which you call after COMMIT (`afterRollback()` after a rollback).
     */
    public function create(
        string $task,
        array $args,
        int $ttlMs,
        ?string $tag = null,
        ?array $retrySchedule = null,
        mixed $payload = null,
    ): string {
        if ($ttlMs < 0 || $ttlMs > self::MAX_HORIZON_MS) {
            throw new ArgumentError("ttlMs must be from 0 to 100 years in ms, got $ttlMs");
        }
        $now = $this->nowMs();
        return $this->write($task, $args, $now + $ttlMs, $now, $tag, $retrySchedule, $payload);
    }

    /**
     * As `create`, due at `$dueAtMs` (epoch milliseconds, compared with Redis's clock). A time
     * in the past is due now: the task runs at once.
     */
    public function createAt(
        string $task,
        array $args,
        int $dueAtMs,
        ?string $tag = null,
        ?array $retrySchedule = null,
        mixed $payload = null,
    ): string {
        $now = $this->nowMs();
        if ($dueAtMs < 0 || $dueAtMs > $now + self::MAX_HORIZON_MS) {
            throw new ArgumentError("dueAtMs must be from 0 (1970) to 100 years from now, got $dueAtMs");
        }
        return $this->write($task, $args, $dueAtMs, $now, $tag, $retrySchedule, $payload);
    }

    /** The due time (epoch ms, Redis's clock) of this producer's last create. */
    public function lastDueAtMs(): ?int
    {
        return $this->lastDueAtMs;
    }

    /** The W3C traceparent the next creates store (docs/PROTOCOL.md), or null for none. */
    public ?string $traceparent = null;

    /** What the last create did: 'created' (a new key) or 'replaced' (an existing row reset). */
    public function lastOutcome(): ?string
    {
        return $this->lastOutcome;
    }

    /**
     * The create statement (docs/PROTOCOL.md): `$rowAlias` for MySQL 8.0.20+, `$withPayload`
     * to write the payload column too.
     */
    public static function createSql(bool $rowAlias = false, bool $withPayload = false): string
    {
        return $rowAlias
            ? self::upsertSql(fn (string $c) => "new.$c", ' AS new', 'ON DUPLICATE KEY UPDATE', '', $withPayload)
            : self::upsertSql(fn (string $c) => "VALUES($c)", '', 'ON DUPLICATE KEY UPDATE', '', $withPayload);
    }

    /**
     * The create statement on a PostgreSQL ledger (docs/PROTOCOL.md): its one column is true
     * for a new key, false for an existing row reset.
     */
    public static function createPostgresSql(bool $withPayload = false): string
    {
        return self::upsertSql(
            fn (string $c) => "excluded.$c",
            '',
            'ON CONFLICT (task_key) DO UPDATE SET',
            "\nRETURNING (xmax = 0) AS inserted",
            $withPayload,
        );
    }

    /** One create statement: `$new('col')` names the value being written. */
    private static function upsertSql(
        \Closure $new,
        string $alias,
        string $onConflict,
        string $returning,
        bool $withPayload,
    ): string {
        $table = self::TABLE;
        $payloadColumn = $withPayload ? ', payload' : '';
        $payloadValue = $withPayload ? ', ?' : '';
        $payloadSet = $withPayload ? ",\n    payload = coalesce({$new('payload')}, $table.payload)" : '';
        return <<<SQL
            INSERT INTO $table (task_key, class_name, method, args, status, attempts,
                retry_schedule_s, due_at_ms, created_at_ms, updated_at_ms, tag$payloadColumn, traceparent)
            VALUES (?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?, ?$payloadValue, ?)$alias
            $onConflict args = {$new('args')}, status = 'pending', attempts = 0,
                retry_schedule_s = {$new('retry_schedule_s')}, due_at_ms = {$new('due_at_ms')},
                created_at_ms = {$new('created_at_ms')},
                updated_at_ms = CASE WHEN ($table.updated_at_ms >= {$new('updated_at_ms')}
                    AND $table.updated_at_ms < 9223372036854775807)
                    THEN $table.updated_at_ms + 1 ELSE {$new('updated_at_ms')} END,
                started_at_ms = NULL, finished_at_ms = NULL, claimed_by = NULL, lease_until_ms = NULL,
                last_error = NULL, tag = coalesce({$new('tag')}, $table.tag), result = NULL$payloadSet,
                traceparent = {$new('traceparent')}$returning
            SQL;
    }

    // --- cancel --------------------------------------------------------------------------------

    /** The cancel statement (docs/PROTOCOL.md). */
    public const CANCEL_SQL = <<<'SQL'
        UPDATE time_limit_task
        SET status = 'cancelled', updated_at_ms = ?, finished_at_ms = ?, claimed_by = ?
        WHERE task_key = ? AND status = 'pending'
        SQL;

    /**
     * Cancel the pending task `$task` with `$args`: true if it was pending (it will not run),
     * false if not (running, done, dead, already cancelled, or absent; a running task finishes).
     * Inside a PDO transaction the key is deleted by `afterCommit()`.
     */
    public function cancel(string $task, array $args): bool
    {
        return $this->cancelKey($this->key($task, $args));
    }

    /** As `cancel`, by key. */
    public function cancelKey(string $key): bool
    {
        $now = $this->nowMs();
        $token = 'cancel:' . bin2hex(random_bytes(16));
        $changed = $this->execute(self::CANCEL_SQL, [$now, $now, $token, $key]);
        if ($changed !== 1) {
            return false;
        }
        // Row, then key: the UPDATE decided; the DEL is housekeeping.
        if ($this->pdo->inTransaction()) {
            $this->afterCommit[] = ['del', $key, 0];
        } else {
            $this->redis('DEL', $key);
        }
        return true;
    }

    // --- in a business transaction ---------------------------------------------------------------

    /**
     * After COMMIT of a transaction in which tasks were created or cancelled: set their keys
     * (delete the cancelled ones'). Forgetting it delays the created tasks (the listener re-arms
     * a pending row without a key 5 to 15 s after its due time); it loses none.
     */
    public function afterCommit(): void
    {
        $pending = $this->afterCommit;
        $this->afterCommit = [];
        if (!$pending) {
            return;
        }
        $now = $this->nowMs();
        foreach ($pending as [$op, $key, $due]) {
            $op === 'set' ? $this->arm($key, $due, $now) : $this->redis('DEL', $key);
        }
    }

    /** After a rollback: forget the keys of the transaction's creates and cancels. */
    public function afterRollback(): void
    {
        $this->afterCommit = [];
    }

    // --- the protocol's steps ------------------------------------------------------------------

    /** Now in epoch ms on Redis's clock (`TIME`). */
    public function nowMs(): int
    {
        $time = $this->redis('TIME');
        if (!is_array($time) || count($time) !== 2) {
            throw new \RuntimeException('Redis TIME gave an unexpected answer');
        }
        return (int) $time[0] * 1000 + intdiv((int) $time[1], 1000);
    }

    private function write(
        string $task,
        array $args,
        int $due,
        int $now,
        ?string $tag,
        ?array $retrySchedule,
        mixed $payload,
    ): string {
        [$class, $method] = self::splitTask($task);
        $texts = self::argTexts($args);
        $key = $this->key($task, $args);
        $params = [
            $key,
            $class,
            $method,
            json_encode($texts, JSON_UNESCAPED_UNICODE | JSON_UNESCAPED_SLASHES | JSON_THROW_ON_ERROR),
            self::scheduleJson($retrySchedule),
            $due,
            $now,
            $now,
            self::checkTag($tag),
        ];
        $withPayload = $payload !== null;
        if ($withPayload) {
            $params[] = $this->payloadJson($payload);
        }
        $params[] = $this->traceparent;  // null: no trace for the handler's span to continue
        $this->checkCharset();
        if ($this->postgres) {
            $inserted = $this->execute(self::createPostgresSql($withPayload), $params, fetch: true);
            // A boolean, or its text under ATTR_STRINGIFY_FETCHES.
            $this->lastOutcome = in_array($inserted, [true, 1, '1', 't'], true) ? 'created' : 'replaced';
        } else {
            $changed = $this->execute(self::createSql($this->rowAlias(), $withPayload), $params);
            // 1: a new key; 2: an existing row reset (docs/PROTOCOL.md).
            $this->lastOutcome = $changed === 1 ? 'created' : 'replaced';
        }
        $this->lastDueAtMs = $due;
        // Row first, then the key: a row without a key is repaired by the listener; a key
        // without a row never runs.
        if ($this->pdo->inTransaction()) {
            $this->afterCommit[] = ['set', $key, $due];
        } else {
            $this->arm($key, $due, $now);
        }
        return $key;
    }

    private function arm(string $key, int $due, int $now): void
    {
        $this->redis('SET', $key, '', 'PXAT', (string) max($due, 1));
        if ($due <= $now) {
            // Due already: a lookup makes Redis expire and announce it at once.
            $this->redis('EXISTS', $key);
        } elseif ($due <= $now + $this->wakeAheadMs) {
            $channel = $this->prefix . '#keyexpiry#wake@' . $this->redis->getDbNum();
            $this->redis('PUBLISH', $channel, "$due $key");
        }
    }

    /** Run `$sql`: its affected rows, or with `$fetch` its first row's first column. */
    private function execute(string $sql, array $params, bool $fetch = false): mixed
    {
        $mode = $this->pdo->getAttribute(\PDO::ATTR_ERRMODE);
        $this->pdo->setAttribute(\PDO::ATTR_ERRMODE, \PDO::ERRMODE_EXCEPTION);
        try {
            $stmt = $this->pdo->prepare($sql);
            foreach (array_values($params) as $i => $value) {
                $type = match (true) {
                    $value === null => \PDO::PARAM_NULL,
                    is_int($value) => \PDO::PARAM_INT,
                    default => \PDO::PARAM_STR,
                };
                $stmt->bindValue($i + 1, $value, $type);
            }
            $stmt->execute();
            return $fetch ? $stmt->fetchColumn() : $stmt->rowCount();
        } finally {
            $this->pdo->setAttribute(\PDO::ATTR_ERRMODE, $mode);
        }
    }

    /** One Redis command as sent (no phpredis prefix or serializer applies). */
    private function redis(string ...$command): mixed
    {
        $reply = $this->redis->rawCommand(...$command);
        if ($reply === false) {
            $error = $this->redis->getLastError();
            $this->redis->clearLastError();
            throw new \RuntimeException("Redis $command[0] failed: " . ($error ?? 'no answer'));
        }
        return $reply;
    }

    private function rowAlias(): bool
    {
        if ($this->rowAlias === null) {
            $version = (string) $this->pdo->getAttribute(\PDO::ATTR_SERVER_VERSION);
            $this->rowAlias = !str_contains($version, 'MariaDB')
                && preg_match('/^(\d+\.\d+\.\d+)/', $version, $m) === 1
                && version_compare($m[1], '8.0.20', '>=');
        }
        return $this->rowAlias;
    }

    /**
     * Non-ASCII arguments, tags and payloads reach the ledger intact only over utf8mb4 (MySQL)
     * or UTF8 (PostgreSQL): the server would convert them from another encoding.
     */
    private function checkCharset(): void
    {
        if ($this->charsetChecked) {
            return;
        }
        $mode = $this->pdo->getAttribute(\PDO::ATTR_ERRMODE);
        $this->pdo->setAttribute(\PDO::ATTR_ERRMODE, \PDO::ERRMODE_EXCEPTION);
        try {
            $sql = $this->postgres ? 'SHOW client_encoding' : 'SELECT @@character_set_client';
            $charset = $this->pdo->query($sql)->fetchColumn();
        } finally {
            $this->pdo->setAttribute(\PDO::ATTR_ERRMODE, $mode);
        }
        if ($this->postgres && $charset !== 'UTF8') {
            throw new \LogicException(
                "the PDO connection's client_encoding is $charset: put options='--client_encoding=UTF8' in its DSN"
            );
        }
        if (!$this->postgres && $charset !== 'utf8mb4') {
            throw new \LogicException(
                "the PDO connection's character set is $charset: put charset=utf8mb4 in its DSN"
            );
        }
        $this->charsetChecked = true;
    }

    // --- checks --------------------------------------------------------------------------------

    private static function checkPrefix(string $prefix): string
    {
        if (str_contains($prefix, '@') || !self::isUtf8($prefix) || self::chars($prefix) > self::MAX_PREFIX_CHARS) {
            throw new ArgumentError(
                'the key prefix must not contain "@" and must be at most ' . self::MAX_PREFIX_CHARS . ' characters'
            );
        }
        return $prefix;
    }

    /** @return array{string, string} */
    private static function splitTask(string $task): array
    {
        $parts = explode('.', $task);
        if (count($parts) !== 2 || !preg_match(self::NAME, $parts[0]) || !preg_match(self::NAME, $parts[1])) {
            throw new ArgumentError(
                'name a task as "Class.method", each a letter then letters, digits or _, got '
                . self::shown($task)
            );
        }
        return $parts;
    }

    /** @return list<string> */
    private static function argTexts(array $args): array
    {
        if (!array_is_list($args)) {
            throw new ArgumentError('arguments must be a list (positional), not keyed');
        }
        return array_map(self::argText(...), $args);
    }

    /** Python's repr of a float (shortest round trip), -0.0 as 0.0: keyexpiry's float text. */
    private static function floatText(float $value): string
    {
        if (!is_finite($value)) {
            throw new ArgumentError('a float argument must be finite, got ' . var_export($value, true));
        }
        if ($value == 0.0) {
            return '0.0';
        }
        // PHP's own shortest round trip (serialize_precision -1), in whatever notation it
        // chooses; rewritten in Python's.
        $saved = ini_get('serialize_precision');
        ini_set('serialize_precision', '-1');
        try {
            $shortest = var_export($value, true);
        } finally {
            ini_set('serialize_precision', (string) $saved);
        }
        if (!preg_match('/^(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?$/D', $shortest, $m)) {
            throw new \LogicException("unexpected float text $shortest");
        }
        $whole = ltrim($m[2], '0');
        $fraction = $m[3] ?? '';
        $all = $whole . $fraction;
        // The value is 0.DIGITS × 10^point.
        $point = strlen($whole) + (int) ($m[4] ?? '0');
        if ($whole === '') {
            $stripped = ltrim($fraction, '0');
            $point -= strlen($fraction) - strlen($stripped);
            $all = $stripped;
        }
        $digits = rtrim($all, '0');
        if ($point <= -4 || $point > 16) {
            $exp = $point - 1;
            $text = $digits[0] . (strlen($digits) > 1 ? '.' . substr($digits, 1) : '')
                . 'e' . ($exp < 0 ? '-' : '+') . str_pad((string) abs($exp), 2, '0', STR_PAD_LEFT);
        } elseif ($point <= 0) {
            $text = '0.' . str_repeat('0', -$point) . $digits;
        } elseif ($point >= strlen($digits)) {
            $text = $digits . str_repeat('0', $point - strlen($digits)) . '.0';
        } else {
            $text = substr($digits, 0, $point) . '.' . substr($digits, $point);
        }
        return $m[1] . $text;
    }

    /** The retry_schedule_s column for `$schedule` (null: NULL); ArgumentError for one keyexpiry refuses. */
    public static function scheduleJson(?array $schedule): ?string
    {
        if ($schedule === null) {
            return null;
        }
        if (!array_is_list($schedule) || count($schedule) > self::MAX_RETRIES) {
            throw new ArgumentError('a retry schedule is a list of at most ' . self::MAX_RETRIES . ' delays');
        }
        foreach ($schedule as $i => $delay) {
            if (!(is_int($delay) || is_float($delay)) || !is_finite((float) $delay)
                || $delay < 0 || $delay > self::MAX_RETRY_DELAY_S
            ) {
                throw new ArgumentError(
                    "retry schedule [$i] must be a number of seconds from 0 to " . self::MAX_RETRY_DELAY_S
                );
            }
        }
        return json_encode($schedule, JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR);
    }

    /** `$tag` if keyexpiry accepts it as a tag (null: none); else ArgumentError. */
    public static function checkTag(?string $tag): ?string
    {
        if ($tag === null) {
            return null;
        }
        if (!self::isUtf8($tag)) {
            throw new ArgumentError('a tag must be valid UTF-8');
        }
        $chars = self::chars($tag);
        if ($chars < 1 || $chars > self::MAX_TAG_CHARS) {
            throw new ArgumentError('a tag must be 1 to ' . self::MAX_TAG_CHARS . " characters, got $chars");
        }
        // keyexpiry's rule (Python's str.isprintable, no blank at either end): no character of
        // Unicode's Other or Separator categories but the ASCII space, and no space at the ends.
        if (preg_match('/(?! )[\p{C}\p{Z}]/u', $tag) || $tag[0] === ' ' || $tag[-1] === ' ') {
            throw new ArgumentError(
                'a tag must not start or end with a blank or hold control characters: ' . self::shown($tag)
            );
        }
        return $tag;
    }

    private function payloadJson(mixed $payload): string
    {
        try {
            $json = json_encode(
                $payload,
                JSON_UNESCAPED_UNICODE | JSON_UNESCAPED_SLASHES | JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR,
                self::MAX_JSON_DEPTH
            );
        } catch (\JsonException $exc) {
            if ($exc->getCode() === JSON_ERROR_DEPTH) {
                throw new ArgumentError(
                    'the payload is nested deeper than ' . self::MAX_JSON_DEPTH . ' levels of arrays and objects',
                    0,
                    $exc
                );
            }
            throw new ArgumentError('the payload is not JSON-encodable: ' . $exc->getMessage(), 0, $exc);
        }
        if (strlen($json) > $this->payloadMaxBytes) {
            throw new ArgumentError(
                'the payload is ' . strlen($json) . " bytes of JSON, more than {$this->payloadMaxBytes}"
            );
        }
        return $json;
    }

    private static function isUtf8(string $text): bool
    {
        return preg_match('//u', $text) === 1;
    }

    private static function chars(string $utf8): int
    {
        return (int) preg_match_all('/./su', $utf8);
    }

    private static function shown(string $text): string
    {
        $cut = strlen($text) > 80 ? substr($text, 0, 80) . '…' : $text;
        return json_encode($cut, JSON_INVALID_UTF8_SUBSTITUTE | JSON_UNESCAPED_UNICODE) ?: '?';
    }
}
