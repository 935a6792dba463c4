"""The evidence pack from the admin (refundops.admin.evidence): only the auditor role (and
superusers) reach it; a forged request from any other role is refused and changes nothing; every
request and download is audited; and an auditor in Chromium fills the form, watches the progress
finish, downloads the ZIP and verifies it with verify_evidence_pack's own function."""

from __future__ import annotations

import io
import json
import re
import zipfile
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit.evidence import new_signing_key, verify_pack
from audit.models import AuditEntry, EvidencePack
from refundops.services.evidence_packs import pack_path
from tests.browser import _orm_beside_playwright, browser  # noqa: F401
from tests.conftest import make_limits, make_rules

LIST = "admin:audit_evidencepack_changelist"


@pytest.fixture
def signing(tmp_path, settings):
    public = new_signing_key(tmp_path / "evidence.pem")
    settings.EVIDENCE_SIGNING_KEY = str(tmp_path / "evidence.pem")
    settings.VAR_DIR = tmp_path / "var"
    return public


def _staff(username: str, role: str | None) -> Client:
    User.objects.create_user(username, password="pw-" + username, is_staff=True)
    if role:
        call_command("grant_role", username, role, stdout=io.StringIO())
    client = Client()
    client.force_login(User.objects.get(username=username))
    return client


def _today() -> str:
    return timezone.now().date().isoformat()


def _evidence_entries():
    return AuditEntry.objects.filter(action__startswith="evidence_pack.")


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["finance approver", "fraud analyst", "operator", "administrator", None])
def test_a_forged_request_from_another_role_gets_403_and_changes_nothing(signing, role):
    auditor = _staff("auditor-1", "auditor")
    auditor.post(reverse(LIST), {"first_day": _today(), "last_day": _today()})
    built = EvidencePack.objects.get()
    entries = _evidence_entries().count()
    other = _staff("someone", role)
    assert other.post(reverse(LIST), {"first_day": _today(), "last_day": _today()}).status_code == 403
    assert other.get(reverse(LIST)).status_code == 403
    assert other.get(reverse("admin:audit_evidencepack_progress", args=[built.pk])).status_code == 403
    assert other.get(reverse("admin:audit_evidencepack_download", args=[built.pk])).status_code == 403
    assert EvidencePack.objects.count() == 1 and _evidence_entries().count() == entries
    index = other.get(reverse("admin:index")).content.decode()
    assert "Evidence packs" not in index  # not even a link to it


@pytest.mark.django_db
def test_the_auditor_builds_and_downloads_a_pack_and_both_are_audited(signing, django_capture_on_commit_callbacks):
    make_limits(), make_rules()
    auditor = _staff("auditor-1", "auditor")
    assert "Evidence packs" in auditor.get(reverse("admin:index")).content.decode()
    with django_capture_on_commit_callbacks(execute=True):  # the outbox's nudge: the (eager) build task
        answer = auditor.post(reverse(LIST), {"first_day": _today(), "last_day": _today()})
    assert answer.status_code == 302
    pack = EvidencePack.objects.get()
    assert (pack.status, pack.percent, pack.requested_by) == ("done", 100, "auditor-1")
    progress = auditor.get(reverse("admin:audit_evidencepack_progress", args=[pack.pk])).json()
    assert progress["status"] == "done" and progress["download"]
    download = auditor.get(progress["download"])
    assert download.status_code == 200 and download["Content-Type"] == "application/zip"
    body = b"".join(download.streaming_content)
    assert body == pack_path(pack).read_bytes()
    actions = list(_evidence_entries().order_by("id").values_list("action", "actor", "subject_id"))
    assert actions == [("evidence_pack.requested", "user:auditor-1", pack.pk),
                       ("evidence_pack.built", "system:evidence_pack", pack.pk),
                       ("evidence_pack.downloaded", "user:auditor-1", pack.pk)]
    page = auditor.get(reverse(LIST)).content.decode()
    assert "PRIVATE" not in page and "BEGIN" not in page  # the key's fingerprint only, never a key


@pytest.mark.django_db
def test_a_bad_period_is_refused_with_its_reason_and_nothing_is_written(signing):
    auditor = _staff("auditor-1", "auditor")
    later = (timezone.now() + timedelta(days=1)).date().isoformat()
    answer = auditor.post(reverse(LIST), {"first_day": later, "last_day": _today()})
    assert answer.status_code == 400 and "The last day is before the first." in answer.content.decode()
    assert not EvidencePack.objects.exists() and not _evidence_entries().exists()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_an_auditor_builds_downloads_and_verifies_a_pack_in_chromium_at_1366(live_server, browser, signing, tmp_path,
                                                                             monkeypatch):
    from refundops import outbox
    from refundops.services.evidence_packs import build_requested_pack
    from tests.browser import shot
    from tests.test_admin_at_1366 import LAPTOP, MEASURE, log_in_at

    queued = []  # the build task, held back from the (eager) worker, so the page shows it waiting
    monkeypatch.setattr(outbox, "send_after_commit", lambda task, kwargs, **_: queued.append(kwargs))

    out = io.StringIO()
    call_command("demo_data", "--json", stdout=out)
    login = next(s for s in json.loads(out.getvalue())["staff"] if s["username"] == "auditor")
    page = log_in_at(browser, live_server.url, "auditor", login["password"], LAPTOP)
    page.click("text=Evidence packs")
    page.fill("#id_first_day", _today())
    page.fill("#id_last_day", _today())
    page.click("input[value='Build the pack']")
    row = page.locator("#evidence-packs tr[data-pack]").first
    assert row.get_attribute("data-status") == "queued" and queued == [{"pack_id": row.get_attribute("data-pack")}]
    build_requested_pack(**queued[0])  # the worker, while the page polls
    row.locator("a.download").wait_for(timeout=60_000)  # shown once a poll saw the build done
    assert row.get_attribute("data-status") == "done"
    assert page.locator("progress").first.get_attribute("value") == "100"
    seen = page.evaluate(MEASURE)
    assert seen["page"] <= seen["width"] and seen["off"] == [], seen
    shot(page, "w1366-evidence-packs")
    with page.expect_download() as download:
        row.locator("a.download").click()
    zipped = tmp_path / "downloaded.zip"
    download.value.save_as(zipped)
    assert verify_pack(zipped, signing) == []
    with zipfile.ZipFile(zipped) as pack:
        assert "summary.html" in pack.namelist()
    assert list(_evidence_entries().values_list("action", flat=True).order_by("id")) == [
        "evidence_pack.requested", "evidence_pack.built", "evidence_pack.downloaded"]
    page.context.close()


def _requested_without_a_worker(monkeypatch, username: str = "auditor-1") -> EvidencePack:
    from refundops import outbox
    from refundops.services import evidence_packs
    monkeypatch.setattr(outbox, "send_after_commit", lambda task, kwargs, **_: None)  # the test plays the worker
    today = timezone.now().date()
    return evidence_packs.request_evidence_pack(username=username, first_day=today, last_day=today)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first_worker", ["alive", "silent past its lease"])
def test_a_second_delivery_of_the_build_while_the_first_runs_neither_builds_again_nor_spoils_the_zip(signing,
                                                                                                   monkeypatch,
                                                                                                   first_worker):
    """The outbox delivers at least once: a second worker taking the task while the first builds
    must leave the pack to it (on main both wrote the same file, and both audited a build). If the
    first was silent past its lease the second takes over, and the first, back, finishes nothing."""
    import threading

    from django.db import connection

    from refundops.services import evidence_packs
    make_limits(), make_rules()
    pack = _requested_without_a_worker(monkeypatch)
    real_build, second = evidence_packs.build_pack, {}

    def deliver_again() -> None:
        try:
            second["pack"] = evidence_packs.build_requested_pack(pack_id=pack.pk)
        finally:
            connection.close()

    def build_while_a_second_worker_takes_the_task(**kwargs):
        def progress(step: str) -> None:
            kwargs["progress"](step)
            if not second:
                second["started"] = True
                if first_worker != "alive":
                    EvidencePack.objects.filter(pk=pack.pk).update(heartbeat_at=timezone.now() - timedelta(days=1))
                worker = threading.Thread(target=deliver_again)
                worker.start(), worker.join()
        return real_build(**{**kwargs, "progress": progress})

    monkeypatch.setattr(evidence_packs, "build_pack", build_while_a_second_worker_takes_the_task)
    first = evidence_packs.build_requested_pack(pack_id=pack.pk)
    if first_worker == "alive":
        assert first.status == "done" and second["pack"].status != "done"  # the second left it to the first
    else:
        assert second["pack"].status == "done"
    built = EvidencePack.objects.get(pk=pack.pk)
    assert built.status == "done"
    assert not list(pack_path(built).parent.glob("*.part"))
    assert AuditEntry.objects.filter(action="evidence_pack.built").count() == 1
    assert verify_pack(pack_path(built), signing) == []
    with zipfile.ZipFile(pack_path(built)) as archive:
        import hashlib
        assert hashlib.sha256(archive.read("manifest.json")).hexdigest() == built.manifest_sha256


@pytest.mark.django_db(transaction=True)
def test_a_pack_whose_worker_died_does_not_show_building_forever(signing, monkeypatch):
    """A worker killed mid-build (no exception, no FAILED) left the row 'building' for good. A builder
    renews its lease at every step; past the lease the page says it failed and why, and a redelivery
    builds it. A builder within its lease is left alone."""
    from refundops.services import evidence_packs
    make_limits(), make_rules()
    pack = _requested_without_a_worker(monkeypatch)
    auditor = _staff("auditor-2", "auditor")
    progress_url = reverse("admin:audit_evidencepack_progress", args=[pack.pk])
    EvidencePack.objects.filter(pk=pack.pk).update(status="building", step="Refunds paid", steps_done=9,
                                                   builder="alive", heartbeat_at=timezone.now())
    assert auditor.get(progress_url).json()["status"] == "building"
    assert evidence_packs.build_requested_pack(pack_id=pack.pk).builder == "alive"  # a redelivery leaves it
    EvidencePack.objects.filter(pk=pack.pk).update(heartbeat_at=timezone.now() - evidence_packs.LEASE
                                                   - timedelta(seconds=1))
    progress = auditor.get(progress_url).json()
    assert progress["status"] == "failed" and "stopped" in progress["error"]
    assert evidence_packs.build_requested_pack(pack_id=pack.pk).status == "done"  # the task, delivered again


@pytest.mark.django_db
def test_a_head_request_for_a_pack_is_not_a_download_and_is_not_audited_as_one(signing,
                                                                             django_capture_on_commit_callbacks):
    make_limits(), make_rules()
    auditor = _staff("auditor-1", "auditor")
    with django_capture_on_commit_callbacks(execute=True):
        auditor.post(reverse(LIST), {"first_day": _today(), "last_day": _today()})
    pack = EvidencePack.objects.get()
    assert auditor.head(reverse("admin:audit_evidencepack_download", args=[pack.pk])).status_code == 405
    assert not _evidence_entries().filter(action="evidence_pack.downloaded").exists()


@pytest.mark.django_db
def test_a_period_ending_on_the_last_day_a_date_can_hold_is_refused_not_queued_to_fail(signing, tmp_path):
    """9999-12-31 passes the form's DateField, and the worker's end (the next midnight) overflows:
    on main the request was accepted and the build failed with 'date value out of range'."""
    auditor = _staff("auditor-1", "auditor")
    answer = auditor.post(reverse(LIST), {"first_day": "9999-12-30", "last_day": "9999-12-31"})
    assert answer.status_code == 400 and "9999-12-31" in answer.content.decode()
    assert not EvidencePack.objects.exists() and not _evidence_entries().exists()
    from django.core.management.base import CommandError
    with pytest.raises(CommandError, match="9999-12-31"):
        call_command("evidence_pack", "--from", "9999-12-30", "--to", "9999-12-31", "--out", str(tmp_path / "p.zip"),
                     stdout=io.StringIO())
    assert not (tmp_path / "p.zip").exists()


@pytest.mark.django_db
def test_the_packs_other_admin_doors_are_shut_to_other_roles_and_the_form_needs_its_csrf_token(signing):
    """Beside the three views: the list's CSV export, a pack's own page and its history (the admin's
    URLs kept under ours); and a POST without the CSRF token, even from an auditor."""
    auditor = _staff("auditor-1", "auditor")
    auditor.post(reverse(LIST), {"first_day": _today(), "last_day": _today()})
    pack = EvidencePack.objects.get()
    finance = _staff("finance-1", "finance approver")
    for url in (reverse("admin:audit_evidencepack_export_csv"), reverse("admin:audit_evidencepack_change", args=[pack.pk]),
                reverse("admin:audit_evidencepack_history", args=[pack.pk])):
        assert finance.get(url).status_code == 403, url
    assert auditor.get(reverse("admin:audit_evidencepack_change", args=[pack.pk])).status_code == 200
    forged = Client(enforce_csrf_checks=True)
    forged.force_login(User.objects.get(username="auditor-1"))
    assert forged.post(reverse(LIST), {"first_day": _today(), "last_day": _today()}).status_code == 403
    assert EvidencePack.objects.count() == 1 and _evidence_entries().count() == 1


@pytest.mark.django_db
def test_a_pack_whose_id_reads_as_an_admin_escape_is_still_found_by_its_links(signing, django_capture_on_commit_callbacks,
                                                                              monkeypatch):
    """The admin unquotes ids in its URLs ("_24" is "$"), so its links must quote them: a pack id
    like ep_24... (ep_22 to ep_26 and ep_40: 6 in 256) answered the page's progress poll with a 404."""
    make_limits(), make_rules()
    auditor = _staff("auditor-1", "auditor")
    from audit import models

    new_id = models.new_id
    monkeypatch.setattr(models, "new_id", lambda prefix: "ep_245f0c1d2e" if prefix == "ep" else new_id(prefix))
    with django_capture_on_commit_callbacks(execute=True):
        auditor.post(reverse(LIST), {"first_day": _today(), "last_day": _today()})
    pack = EvidencePack.objects.get()
    assert pack.pk == "ep_245f0c1d2e" and pack.status == "done"
    page = auditor.get(reverse(LIST)).content.decode()
    progress_url = re.search(r'data-progress-url="([^"]+)"', page).group(1)
    progress = auditor.get(progress_url)
    assert progress.status_code == 200 and progress.json()["id"] == pack.pk
    download = auditor.get(progress.json()["download"])
    assert download.status_code == 200 and download["Content-Type"] == "application/zip"
