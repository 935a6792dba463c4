"""Model instances from hand-written SQL, made as the ORM makes them (its database converters,
then ``Model.from_db``). For the reads every request makes, where compiling the ORM's query
costs several times what PostgreSQL takes to run it (a locked payment with its customer: about
2 ms of Python for 0.05 ms of SQL). The column lists come from the models, so a new field is read
here too."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Sequence

from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.models import Field, Model

from refundops import batching


def db():
    """This thread's default connection, itself: ``django.db.connection`` is a proxy that looks it
    up again on every attribute (asgiref's Local, and an AttributeError raised and caught each
    time, ~1.2 µs). For code that uses it several times a request."""
    return connections[DEFAULT_DB_ALIAS]


class Columns:
    """Every concrete column of ``model`` under the SQL alias ``alias``, and the instance a row's
    slice of them makes."""

    def __init__(self, model: type[Model], alias: str) -> None:
        self.model, self.alias = model, alias
        self.fields = tuple(model._meta.concrete_fields)
        self.names = [field.attname for field in self.fields]
        self._converters: list[tuple[int, Any, list]] | None = None

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def sql(self) -> str:
        quote = connection.ops.quote_name
        return ", ".join(f"{self.alias}.{quote(field.column)}" for field in self.fields)

    def make(self, values: Sequence[Any]) -> Model:
        if self._converters is None:  # as SQLCompiler.get_converters: the backend's, then the field's
            self._converters = []
            for i, field in enumerate(self.fields):
                column = field.get_col(self.alias)
                converters = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
                if converters:
                    self._converters.append((i, column, converters))
        if self._converters:
            values = list(values)
            wrapper = db()
            for i, column, converters in self._converters:
                for convert in converters:
                    values[i] = convert(values[i], column, wrapper)
        return self.model.from_db(DEFAULT_DB_ALIAS, self.names, values)


def cache_related(instance: Model, field_name: str, related: Model) -> None:
    """What ``select_related(field_name)`` leaves on ``instance``: the related row, no query."""
    type(instance)._meta.get_field(field_name).set_cached_value(instance, related)


_INSERTS: dict[tuple[type[Model], int], tuple[str, Prepared, bool]] = {}


def insert(model: type[Model], objs: Sequence[Model]) -> None:
    """``model.objects.bulk_create(objs)``: one INSERT, each value prepared as the ORM prepares it
    (``pre_save``, ``get_db_prep_save``), no signals (nor does bulk_create send any). A plain VALUES
    list: bulk_create's arrays cost more to spell out. In a batch (refundops.batching) it is sent with
    the next statement; a key the database draws is read back then (RETURNING, on PostgreSQL).
    Elsewhere (SQLite) Django's own ``bulk_create``, which reads such keys back too: a row without
    its key cannot be recorded by an audit entry (the worker's history rows)."""
    if connection.vendor != "postgresql":
        model._base_manager.bulk_create(objs)
        return
    statement = _INSERTS.get((model, len(objs)))
    if statement is None:
        fields = [f for f in model._meta.concrete_fields if not f.generated and not (f.primary_key and f.db_returning)]
        quote = connection.ops.quote_name
        row = "(" + ", ".join(["%s"] * len(fields)) + ")"
        returns = model._meta.pk.db_returning
        statement = _INSERTS[model, len(objs)] = (
            f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) VALUES "
            + ", ".join([row] * len(objs)) + (f" RETURNING {quote(model._meta.pk.column)}" if returns else ""),
            Prepared(fields), returns)
    sql, prepared, returns = statement
    params = [value for obj in objs for value in prepared(obj)]

    def saved(cursor) -> None:
        for obj, row in zip(objs, cursor.fetchall() if returns else [None] * len(objs), strict=True):
            if row is not None:
                obj.pk = row[0]
            obj._state.adding, obj._state.db = False, DEFAULT_DB_ALIAS  # as Model.save leaves it

    batching.defer(sql, params, then=saved)


# Fields whose get_db_prep_save gives a value of these exact types back unchanged on PostgreSQL
# (to_python and get_prep_value return such a value as it is, the backend's adapt_*_value too; an
# integer is wrapped in psycopg's IntN as the backend wraps it). A subclass that changes any of
# those steps goes the ORM's own way, as does any other type of value (a naive datetime is made
# aware there, with a warning; a bool given to an IntegerField becomes an int; JSON is wrapped).
_AS_IS: dict[type[Field], tuple[type, ...]] = {
    models.CharField: (str,), models.TextField: (str,), models.BooleanField: (bool,),
    models.IntegerField: (int,), models.BigIntegerField: (int,), models.PositiveIntegerField: (int,),
    models.SmallIntegerField: (int,), models.PositiveSmallIntegerField: (int,),
    models.PositiveBigIntegerField: (int,), models.DateField: (date,), models.DateTimeField: (datetime,)}
_STEPS = ("get_db_prep_save", "get_db_prep_value", "get_prep_value", "to_python")


def kept_types(field: Field) -> tuple[type, ...]:
    """The types of value ``field`` (a foreign key: its target) sends to PostgreSQL as they are
    (and, the same steps, that its to_python returns as they are)."""
    if isinstance(field, models.ForeignKey):
        if type(field).get_db_prep_save is not models.ForeignKey.get_db_prep_save:
            return ()
        return kept_types(field.target_field) if field.target_field.empty_strings_allowed else ()
    base = next((cls for cls in type(field).__mro__ if cls in _AS_IS), None)
    if base is None or any(getattr(type(field), step) is not getattr(base, step) for step in _STEPS):
        return ()
    return _AS_IS[base]


class Prepared:
    """``[field.get_db_prep_save(field.pre_save(obj, True), connection) for field in fields]``: the
    values an INSERT of ``obj`` sends, as the ORM prepares them. On PostgreSQL a value its field
    gives back as it is (``kept_types``) skips the field's chain of calls: an approved refund's INSERTs
    spent more on those calls than on binding the values."""

    def __init__(self, fields: Sequence[Field]) -> None:
        on_pg = connection.vendor == "postgresql"
        wraps = getattr(connection.ops, "integerfield_type_map", {}) if on_pg else {}
        self.fields = tuple(fields)
        self.steps = [(field, field.attname, kept_types(field) if on_pg else (),
                       type(field).pre_save is not Field.pre_save,
                       wraps.get(field.target_field.get_internal_type() if isinstance(field, models.ForeignKey)
                                 else field.get_internal_type()))
                      for field in self.fields]

    def __call__(self, obj: Model) -> list[Any]:
        values, wrapper = [], db()
        for field, attname, as_is, pre_save, wrap in self.steps:
            value = field.pre_save(obj, True) if pre_save else getattr(obj, attname)
            if value is None and as_is:
                pass  # None for every field above
            elif type(value) in as_is and not (type(value) is datetime and value.tzinfo is None):
                if wrap is not None:
                    value = wrap(value)
            else:
                value = field.get_db_prep_save(value, wrapper)
            values.append(value)
        return values


def save_new(obj: Model) -> None:
    """``obj.save()`` for a new row with no signals to send: on PostgreSQL ``insert`` (so in a batch
    it rides with the next statement), the ORM elsewhere."""
    if connection.vendor == "postgresql":
        insert(type(obj), [obj])
    else:
        obj.save(force_insert=True)
