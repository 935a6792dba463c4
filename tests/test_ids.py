"""audit.ids: the ids' format, their text order following time, uniqueness across threads, and
fully random ids where an id is the only secret."""

import re
import threading

from audit import ids
from refundops.models import new_payment_link_id, new_refund_id, new_webhook_secret

SHAPE = re.compile(r"^[a-z]+_[0-9a-f]{24}$")  # CONTRACT.md's prefixes, audit.admin.ID_SHAPE


def test_format_is_the_prefix_and_24_lowercase_hex():
    for made in (ids.new_id("vd"), ids.new_id("whsec"), new_refund_id(), ids.new_secret("pl")):
        assert SHAPE.match(made), made
    assert new_refund_id().startswith("rf_")


def test_the_first_12_hex_are_the_milliseconds_and_48_bits_are_random(monkeypatch):
    monkeypatch.setattr(ids.time, "time_ns", lambda: 1_765_000_000_123_456_789)
    made = {ids.new_id("vd") for _ in range(1000)}
    assert {m[3:15] for m in made} == {f"{1_765_000_000_123:012x}"}
    assert len({m[15:] for m in made}) == 1000  # the other 12 hex differ within one millisecond


def test_text_order_follows_time_across_milliseconds(monkeypatch):
    clock = iter(range(1_765_000_000_000, 1_765_000_000_000 + 300 * 7919, 7919))  # ms, crossing hex digits
    made = []
    for ms in clock:
        monkeypatch.setattr(ids.time, "time_ns", lambda ms=ms: ms * 1_000_000 + 999_999)
        made.append(ids.new_id("rf"))
    assert sorted(made) == made


def test_text_order_follows_the_wall_clock():
    """An id made after another, in a later millisecond, sorts after it."""
    first = ids.new_id("rf")
    while ids.time.time_ns() // 1_000_000 == int(first[3:15], 16):
        pass
    assert ids.new_id("rf") > first


def test_unique_under_many_threads():
    made: list[list[str]] = [[] for _ in range(16)]
    start = threading.Barrier(16)

    def make(out: list[str]) -> None:
        start.wait()
        out.extend(ids.new_id("vd") for _ in range(5000))

    threads = [threading.Thread(target=make, args=(out,)) for out in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for out in made for i in out]
    assert len(every) == 80_000 and len(set(every)) == 80_000


def test_an_id_that_is_the_only_secret_stays_fully_random(monkeypatch):
    """/pay/<link id> asks for nothing else, and a webhook secret signs events: neither may carry
    the time (96 random bits, as before)."""
    monkeypatch.setattr(ids.time, "time_ns", lambda: 1_765_000_000_123_456_789)
    stamp = f"{1_765_000_000_123:012x}"
    links = [new_payment_link_id() for _ in range(200)]
    secrets_ = [new_webhook_secret() for _ in range(200)]
    assert all(SHAPE.match(s) for s in links + secrets_)
    assert all(link.startswith("pl_") for link in links) and all(s.startswith("whsec_") for s in secrets_)
    # A time prefix would repeat: 200 random 12-hex heads never all share one, and none is the clock's.
    assert not any(s.split("_", 1)[1].startswith(stamp) for s in links + secrets_)
    assert len({s.split("_", 1)[1][:12] for s in links}) == 200
    assert len({s.split("_", 1)[1][:12] for s in secrets_}) == 200
