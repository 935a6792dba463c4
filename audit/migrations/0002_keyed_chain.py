"""The keyed, sealed audit chain (audit/chain.py): entries get a MAC under AUDIT_KEY, the rows they
record, and a seal; an existing chain is checked under the old unkeyed scheme and keyed anew; then
PostgreSQL is told to refuse every UPDATE but the sealer's, and every DELETE and TRUNCATE.

Plain triggers rather than django-pgtrigger: pgtrigger's triggers step aside for any session that
sets ``pgtrigger.ignore``, which every role may do; these give way only to a superuser or the
table's owner (session_replication_role, ALTER TABLE … DISABLE TRIGGER), and what those do is
caught by the keyed chain and the head kept outside the database."""

import hashlib
import json
import uuid

from django.db import migrations, models
from django.utils import timezone

APPEND_ONLY = """
CREATE FUNCTION audit_entry_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The one change an entry ever takes: the sealer fills in its place in the chain, once.
    IF TG_OP = 'UPDATE' THEN
        IF OLD.seq IS NULL AND NEW.seq IS NOT NULL
           AND to_jsonb(NEW) - '{seq,prev_hash,hash,sealed_at}'::text[]
               = to_jsonb(OLD) - '{seq,prev_hash,hash,sealed_at}'::text[] THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'audit entries are append-only: % on % refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER audit_entry_append_only BEFORE UPDATE OR DELETE ON audit_auditentry
    FOR EACH ROW EXECUTE FUNCTION audit_entry_append_only();
CREATE TRIGGER audit_entry_no_truncate BEFORE TRUNCATE ON audit_auditentry
    FOR EACH STATEMENT EXECUTE FUNCTION audit_entry_append_only();
"""

DROP_APPEND_ONLY = """
DROP TRIGGER audit_entry_no_truncate ON audit_auditentry;
DROP TRIGGER audit_entry_append_only ON audit_auditentry;
DROP FUNCTION audit_entry_append_only();
"""


def _unkeyed_hash(entry) -> str:
    """The chain's hash before this migration (plain SHA-256), to check what is being keyed."""
    body = json.dumps(
        {"seq": entry.seq, "created_at": entry.created_at.isoformat(), "actor": entry.actor,
         "action": entry.action, "subject_type": entry.subject_type, "subject_id": entry.subject_id,
         "data": entry.data, "prev_hash": entry.prev_hash},
        sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def key_existing_chain(apps, schema_editor):
    from audit.chain import GENESIS, entry_mac, link_hash  # functions of a row and AUDIT_KEY only

    AuditEntry = apps.get_model("audit", "AuditEntry")
    old_prev, new_prev, now, batch = GENESIS, GENESIS, timezone.now(), []
    for expected, entry in enumerate(AuditEntry.objects.order_by("seq").iterator(chunk_size=2000), start=1):
        if entry.seq != expected or entry.prev_hash != old_prev or entry.hash != _unkeyed_hash(entry):
            raise RuntimeError(f"audit entry #{entry.seq} (id {entry.pk}) does not verify under the old chain; "
                               f"this migration keys only a chain that verifies (run verify_audit first)")
        old_prev = entry.hash
        entry.uid, entry.records, entry.sealed_at = uuid.uuid4(), [], now
        entry.mac = entry_mac(entry)
        entry.prev_hash = new_prev
        entry.hash = new_prev = link_hash(entry)
        batch.append(entry)
        if len(batch) == 2000:
            AuditEntry.objects.bulk_update(batch, ["uid", "records", "mac", "prev_hash", "hash", "sealed_at"])
            batch = []
    AuditEntry.objects.bulk_update(batch, ["uid", "records", "mac", "prev_hash", "hash", "sealed_at"])


def refuse_edits(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":  # the embedded SQLite mode has the MACs only
        schema_editor.execute(APPEND_ONLY, params=None)  # its % are PL/pgSQL


def allow_edits(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_APPEND_ONLY, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.AddField("auditentry", "uid", models.UUIDField(null=True, editable=False)),
        migrations.AddField("auditentry", "records", models.JSONField(blank=True, default=list)),
        migrations.AddField("auditentry", "mac", models.CharField(max_length=64, default=""),
                            preserve_default=False),
        migrations.AddField("auditentry", "sealed_at", models.DateTimeField(blank=True, null=True)),
        migrations.AlterField("auditentry", "seq", models.BigIntegerField(blank=True, null=True, unique=True)),
        migrations.AlterField("auditentry", "prev_hash", models.CharField(blank=True, max_length=64)),
        migrations.AlterField("auditentry", "hash", models.CharField(blank=True, max_length=64)),
        migrations.RunPython(key_existing_chain, migrations.RunPython.noop),
        migrations.AlterField("auditentry", "uid",
                              models.UUIDField(default=uuid.uuid4, editable=False, unique=True)),
        migrations.AlterModelOptions("auditentry", {"ordering": ["-id"], "verbose_name_plural": "audit entries"}),
        migrations.AddIndex("auditentry", models.Index(condition=models.Q(seq__isnull=True), fields=["id"],
                                                       name="audit_entry_unsealed")),
        migrations.RunPython(refuse_edits, allow_edits),
    ]
