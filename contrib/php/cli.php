<?php

/**
 * Drives Keyexpiry\Producer from JSON (tests/test_php_producer.py uses it; also handy by hand).
 *
 *     php contrib/php/cli.php < commands.json
 *
 * Input, one JSON object:
 *
 *     {"mysql": {"host": "127.0.0.1", "port": 3306, "database": "shop", "user": "root",
 *                "password": "", "charset": "utf8mb4"},          (optional: key/decimal/sql only)
 *      "pgsql": {"host": "127.0.0.1", "port": 5432, "database": "shop", "user": "postgres",
 *                "password": "", "client_encoding": null},      (instead of "mysql"; null
 *                                                                 encoding: the server's default)
 *      "redis": {"host": "127.0.0.1", "port": 6379, "db": 0, "password": null},   (optional too)
 *      "prefix": "",
 *      "commands": [{"op": "create", "task": "Probe.record", "args": ["x"], "ttl_ms": 500}, ...]}
 *
 * Output: a JSON list with one answer per command, {"ok": value} or {"error": class,
 * "message": text}. Commands (optional fields in brackets):
 *
 *     key        task, args                     → the key (no connections needed)
 *     keys       task, args_list                → one answer per argument list, each
 *                                                 {"ok": key} or {"error": ...}
 *     decimal    value                          → Producer::decimal(value)
 *     check_tag  tag                            → Producer::checkTag(tag)
 *     check_schedule schedule                   → Producer::scheduleJson(schedule)
 *     sql                                       → the create (MySQL, PostgreSQL) and cancel
 *                                                 statements
 *     now                                       → Redis's time in epoch ms
 *     create     task, args, ttl_ms, [tag, retry_schedule, payload]
 *     create_at  task, args, due_at_ms, [tag, retry_schedule, payload]
 *                                               → {"key", "due_at_ms", "outcome"}
 *     cancel     task, args                     → true if it was pending
 *     cancel_key key                            → the same, by key
 *     begin / commit / rollback                 → a PDO transaction (commit then afterCommit)
 *
 * Arguments are JSON values: a number with a point or an exponent is a PHP float, one without
 * an int; strings, true and false as they are.
 */

declare(strict_types=1);

require __DIR__ . '/Keyexpiry.php';

use Keyexpiry\Producer;

function connect_mysql(?object $c): ?PDO
{
    if ($c === null) {
        return null;
    }
    $dsn = sprintf(
        'mysql:host=%s;port=%d;dbname=%s;charset=%s',
        $c->host ?? '127.0.0.1',
        $c->port ?? 3306,
        $c->database,
        $c->charset ?? 'utf8mb4'
    );
    return new PDO($dsn, $c->user ?? 'root', $c->password ?? '', [PDO::ATTR_ERRMODE => PDO::ERRMODE_EXCEPTION]);
}

function connect_pgsql(?object $c): ?PDO
{
    if ($c === null) {
        return null;
    }
    $dsn = sprintf('pgsql:host=%s;port=%d;dbname=%s', $c->host ?? '127.0.0.1', $c->port ?? 5432, $c->database);
    if (($c->client_encoding ?? null) !== null) {
        // libpq's connection options, as a DSN says them.
        $dsn .= ";options='--client_encoding={$c->client_encoding}'";
    }
    return new PDO($dsn, $c->user ?? 'postgres', $c->password ?? '', [PDO::ATTR_ERRMODE => PDO::ERRMODE_EXCEPTION]);
}

function connect_redis(?object $c): ?Redis
{
    if ($c === null) {
        return null;
    }
    $redis = new Redis();
    $redis->connect($c->host ?? '127.0.0.1', $c->port ?? 6379, 10.0);
    if (($c->password ?? null) !== null) {
        $redis->auth($c->password);
    }
    $redis->select($c->db ?? 0);
    return $redis;
}

/** JSON objects (stdClass) as PHP arrays, for the values a producer takes as arrays. */
function as_array(mixed $value): mixed
{
    return $value === null ? null : json_decode(json_encode($value), true);
}

function answer(callable $run): array
{
    try {
        return ['ok' => $run()];
    } catch (Throwable $exc) {
        return ['error' => get_class($exc), 'message' => $exc->getMessage()];
    }
}

$input = json_decode(stream_get_contents(STDIN), false, 512, JSON_THROW_ON_ERROR);
$prefix = $input->prefix ?? '';
$pdo = connect_mysql($input->mysql ?? null) ?? connect_pgsql($input->pgsql ?? null);
$redis = connect_redis($input->redis ?? null);
$producer = $pdo !== null && $redis !== null ? new Producer($pdo, $redis, $prefix) : null;

$need = function () use ($producer): Producer {
    return $producer ?? throw new LogicException('this command needs "mysql" or "pgsql", and "redis"');
};

$answers = [];
foreach ($input->commands as $cmd) {
    $answers[] = answer(function () use ($cmd, $prefix, $need, $pdo) {
        switch ($cmd->op) {
            case 'key':
                return Producer::keyFor($cmd->task, $cmd->args, $prefix);
            case 'keys':
                return array_map(
                    fn ($args) => answer(fn () => Producer::keyFor($cmd->task, $args, $prefix)),
                    $cmd->args_list
                );
            case 'decimal':
                return Producer::decimal($cmd->value);
            case 'check_tag':
                return Producer::checkTag($cmd->tag);
            case 'check_schedule':
                return Producer::scheduleJson(as_array($cmd->schedule));
            case 'sql':
                return [
                    'create' => Producer::createSql(false, false),
                    'create_mysql8' => Producer::createSql(true, false),
                    'create_payload' => Producer::createSql(false, true),
                    'create_payload_mysql8' => Producer::createSql(true, true),
                    'create_postgres' => Producer::createPostgresSql(false),
                    'create_payload_postgres' => Producer::createPostgresSql(true),
                    'cancel' => Producer::CANCEL_SQL,
                ];
            case 'now':
                return $need()->nowMs();
            case 'create':
            case 'create_at':
                $p = $need();
                $extra = [
                    $cmd->tag ?? null,
                    as_array($cmd->retry_schedule ?? null),
                    $cmd->payload ?? null,
                ];
                $key = $cmd->op === 'create'
                    ? $p->create($cmd->task, $cmd->args, $cmd->ttl_ms, ...$extra)
                    : $p->createAt($cmd->task, $cmd->args, $cmd->due_at_ms, ...$extra);
                return ['key' => $key, 'due_at_ms' => $p->lastDueAtMs(), 'outcome' => $p->lastOutcome()];
            case 'cancel':
                return $need()->cancel($cmd->task, $cmd->args);
            case 'cancel_key':
                return $need()->cancelKey($cmd->key);
            case 'begin':
                $need();
                return $pdo->beginTransaction();
            case 'commit':
                $pdo->commit();
                $need()->afterCommit();
                return true;
            case 'rollback':
                $pdo->rollBack();
                $need()->afterRollback();
                return true;
            default:
                throw new InvalidArgumentException("unknown op {$cmd->op}");
        }
    });
}
echo json_encode($answers, JSON_UNESCAPED_SLASHES | JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR), "\n";
