"""Drop the ``varchar_pattern_ops`` twins of the indexes on the tables every refund decision writes.

On PostgreSQL Django gives every indexed ``CharField`` (foreign keys and primary keys included) a
second index, ``…_like``, for ``LIKE 'prefix%'`` (``__startswith``). Nothing here filters these
columns by prefix (equality is served by the plain index, which PostgreSQL then uses), yet an
approved refund wrote 22 of its 79 index entries into them (docs/PERFORMANCE.md). A later
``AlterField`` of one of these columns may make Django create its twin again; drop it again then.
Reversing recreates them."""

from django.db import migrations

COLUMNS = {
    "refundops_refund": ("id", "payment_id", "agent_id", "agent_session_id", "verdict_id"),
    "refundops_historicalrefund": ("id", "payment_id", "agent_id", "agent_session_id", "verdict_id"),
    "audit_verdict": ("id", "code", "agent_id", "payment_id", "refund_id"),
    "audit_auditentry": ("action", "subject_id"),
}


def pattern_ops_indexes(cursor) -> list[str]:
    """The name of each twin Django made on one of COLUMNS: named ``…_like``, on that
    column alone with ``varchar_pattern_ops`` (``text_pattern_ops`` for a text column), no predicate.
    An index someone made by hand for prefix searches is left alone."""
    cursor.execute("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
                   " AND tablename = ANY(%s) AND indexname LIKE %s", [list(COLUMNS), "%\\_like"])
    return [name for table, name, definition in cursor.fetchall()
            if any(definition.endswith((f"USING btree ({column} varchar_pattern_ops)",
                                        f"USING btree ({column} text_pattern_ops)"))
                   for column in COLUMNS[table])]


def drop(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        # DROP INDEX locks its table exclusively and, while it waits for a running transaction,
        # queues every refund behind it: give up instead (the migration fails; run it again).
        cursor.execute("SET LOCAL lock_timeout = '10s'")
        for name in pattern_ops_indexes(cursor):
            schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(name)}")


def recreate(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, columns in COLUMNS.items():
        model = next(m for m in apps.get_models() if m._meta.db_table == table)
        for column in columns:
            field = next(f for f in model._meta.local_fields if f.column == column)
            statement = schema_editor._create_like_index_sql(model, field)  # None: the field needs none now
            if statement is not None:  # a later AlterField may have made it again already
                schema_editor.execute(str(statement).replace("CREATE INDEX ", "CREATE INDEX IF NOT EXISTS ", 1))


class Migration(migrations.Migration):
    dependencies = [
        ("refundops", "0016_refund_totals"),
        ("audit", "0003_verdict_policy_input_shadow"),
    ]

    operations = [migrations.RunPython(drop, recreate)]
