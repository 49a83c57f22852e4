"""The ledger's tables: keyexpiry's own DDL (`keyexpiry.django.ledger_ddl`), and the state of
the read-only models over them (unmanaged: Django creates no table of its own)."""

from django.db import migrations, models

from keyexpiry.django.ledger_ddl import create_ledger


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 (Django reads it as declared)
    operations = [  # noqa: RUF012
        # Not reversed: unapplying keyexpiry's migrations never drops the ledger and its rows.
        migrations.RunPython(create_ledger, migrations.RunPython.noop, elidable=False),
        migrations.CreateModel(
            name="Task",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("task_key", models.CharField(max_length=512, unique=True)),
                ("class_name", models.CharField(max_length=128)),
                ("method", models.CharField(max_length=128)),
                ("args", models.TextField()),
                ("status", models.CharField(max_length=16)),
                ("attempts", models.IntegerField()),
                ("retry_schedule_s", models.TextField(null=True)),
                ("due_at_ms", models.BigIntegerField()),
                ("created_at_ms", models.BigIntegerField()),
                ("updated_at_ms", models.BigIntegerField()),
                ("started_at_ms", models.BigIntegerField(null=True)),
                ("finished_at_ms", models.BigIntegerField(null=True)),
                ("claimed_by", models.CharField(max_length=96, null=True)),
                ("lease_until_ms", models.BigIntegerField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("tag", models.CharField(max_length=128, null=True)),
                ("result", models.TextField(null=True)),
                ("payload", models.TextField(null=True)),
                ("traceparent", models.CharField(max_length=55, null=True)),
                ("schedule_name", models.CharField(max_length=200, null=True)),
            ],
            options={"db_table": "time_limit_task", "ordering": ("due_at_ms",), "managed": False},
        ),
        migrations.CreateModel(
            name="Schedule",
            fields=[
                ("name", models.CharField(max_length=200, primary_key=True, serialize=False)),
                ("task_key", models.CharField(max_length=512)),
                ("class_name", models.CharField(max_length=128)),
                ("method", models.CharField(max_length=128)),
                ("cron", models.CharField(max_length=200, null=True)),
                ("every_ms", models.BigIntegerField(null=True)),
                ("tz", models.CharField(max_length=64)),
            ],
            options={"db_table": "keyexpiry_schedule", "managed": False},
        ),
        migrations.CreateModel(
            name="Listener",
            fields=[
                ("id", models.CharField(max_length=96, primary_key=True, serialize=False)),
                ("host", models.CharField(max_length=255)),
                ("pid", models.IntegerField()),
                ("started_at_ms", models.BigIntegerField()),
                ("heartbeat_at_ms", models.BigIntegerField()),
                ("running", models.IntegerField()),
            ],
            options={"db_table": "keyexpiry_listener", "managed": False},
        ),
    ]
