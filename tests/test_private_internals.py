"""Each private part of Django, psycopg, asgiref, Celery or uvicorn-worker the platform still leans
on, checked here as the code uses it, so that the upgrade that changes one fails here, by name,
before it fails a refund. The list, with why each is kept: docs/PERFORMANCE.md, "Private internals
leaned on". (Issue 30.)"""

from __future__ import annotations

import inspect

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.django_db(transaction=True)
def test_django_connection_state_batching_and_the_outbox_read():
    """refundops.batching: ``in_atomic_block``, ``closed_in_transaction``, ``wrap_database_errors``;
    refundops.outbox._pending_nudge: ``savepoint_ids`` and ``run_on_commit``'s (savepoints, hook,
    robust) entries."""
    assert connection.in_atomic_block is False
    with transaction.atomic():
        assert connection.in_atomic_block is True and connection.closed_in_transaction is False
        with transaction.atomic():
            (savepoint,) = connection.savepoint_ids

            def hook() -> None:
                pass

            transaction.on_commit(hook, robust=True)
            (entry,) = connection.run_on_commit
            assert entry == ({savepoint}, hook, True)
        transaction.set_rollback(True)
    with pytest.raises(DatabaseError), connection.wrap_database_errors:  # psycopg's error as Django's
        raise psycopg.errors.DivisionByZero("division by zero")


def test_django_orm_steps_rows_replays():
    """refundops/rows.py reads rows as the ORM does (``ops.get_db_converters``, each field's
    ``get_db_converters``) and leaves a related row where ``select_related`` would (``set_cached_value``)."""
    from django.db.backends.postgresql.operations import DatabaseOperations
    from django.db.models import Field
    from django.db.models.fields.related import ForeignKey

    assert parameters(DatabaseOperations.get_db_converters) == ["self", "expression"]
    assert parameters(Field.get_db_converters) == ["self", "connection"]
    assert parameters(ForeignKey.set_cached_value) == ["self", "instance", "value"]


def test_djangos_asgi_handler_methods_the_threaded_handler_calls():
    """refundops/asgi_handler.py runs Django's ASGIHandler steps on threads of its own."""
    from django.core.handlers.asgi import ASGIHandler

    assert parameters(ASGIHandler.read_body) == ["self", "receive"]
    assert parameters(ASGIHandler.create_request) == ["self", "scope", "body_file"]
    assert parameters(ASGIHandler.send_response) == ["self", "response", "send"]
    assert parameters(ASGIHandler.listen_for_disconnect) == ["self", "receive"]
    assert parameters(ASGIHandler.handle) == ["self", "scope", "receive", "send"]
    assert parameters(ASGIHandler.load_middleware) == ["self", "is_async"]


def test_asgiref_thread_sensitive_context():
    from asgiref.sync import ThreadSensitiveContext

    assert inspect.iscoroutinefunction(ThreadSensitiveContext.__aenter__)


def test_uvicorn_workers_serve_reads_its_sockets_and_config_backlog():
    """refundops/serving.py wraps ``self.sockets`` and sets ``self.config.backlog`` before
    uvicorn-worker's ``_serve`` starts uvicorn on them."""
    from uvicorn_worker import UvicornWorker

    assert inspect.iscoroutinefunction(UvicornWorker._serve)
    source = inspect.getsource(UvicornWorker._serve)
    assert "self.sockets" in source and "self.config" in source


def test_psycopg_pipeline_and_prepared_statements_are_the_documented_ones():
    """Nothing private of psycopg's is used any more (issue 30): pipeline mode and the connection's
    ``prepare_threshold`` and ``prepared_max`` are its public API."""
    assert all(hasattr(psycopg.Connection, name) for name in ("pipeline", "prepare_threshold", "prepared_max"))


def test_djangos_every_value_list_filter_keeps_its_choices_and_chosen_value_where_ours_replace_them():
    """audit/admin.py's IndexedValuesListFilter and RecentValuesListFilter replace
    ``AllValuesFieldListFilter.lookup_choices`` (a lazy DISTINCT set in ``__init__``, read by
    ``choices()``) after ``__init__``, and read the chosen value from ``lookup_val`` (a list)."""
    from django.contrib.admin.filters import AllValuesFieldListFilter

    init, choices = inspect.getsource(AllValuesFieldListFilter.__init__), inspect.getsource(
        AllValuesFieldListFilter.choices)
    assert "self.lookup_choices = (" in init and ".distinct()" in init
    assert "self.lookup_val = params.get(self.lookup_kwarg)" in init
    assert "for i, val in enumerate(self.lookup_choices)" in choices and "val in self.lookup_val" in choices
