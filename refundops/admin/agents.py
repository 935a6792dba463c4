"""Operators' pages: agents, their keys and capabilities, the platform switches, idempotency records."""


from django import forms
from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from django.db.models import Count, Q
from django.utils import timezone

from audit.admin import (
    EstimatedCountPaginator,
    HistoryAdmin,
    ReadOnlyAdmin,
    ReadOnlyHistoryAdmin,
    RecentValuesListFilter,
)
from refundops.models import (
    AgentRead,
    Merchant,
    Agent,
    AgentKey,
    Capability,
    IdempotencyRecord,
    PlatformState,
)
from refundops.services import agents
from proposals.admin import ProposeChangeMixin
from proposals.models import Proposal
from refundops.admin.base import ReadOnlyInline


# -- agents, keys and the platform switches ---------------------------------------------------------

class AgentKeyInline(ReadOnlyInline, admin.TabularInline):
    model = AgentKey
    fields = ["prefix", "created_at", "last_used_at", "expires_at", "revoked_at"]
    readonly_fields = fields


class AgentCapabilitiesForm(forms.ModelForm):
    capabilities = forms.MultipleChoiceField(choices=Capability.choices, required=False,
                                             widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = Agent
        fields = ["capabilities"]


@admin.register(Agent)
class AgentAdmin(ProposeChangeMixin, HistoryAdmin):
    """Agents are created by ``manage.py create_agent`` (the key is shown once, there). Here an
    operator revokes capabilities at once, or proposes granting some (a second operator approves),
    each through the audited service."""

    proposal_kind = Proposal.Kind.AGENT_CAPABILITIES
    form = AgentCapabilitiesForm
    ordering = ["name"]
    list_display = ["name", "id", "merchant", "owner", "capability_list", "is_active", "live_keys", "created_at"]
    list_filter = ["is_active", "merchant"]
    list_select_related = ["merchant"]
    search_fields = ["name", "id", "owner"]
    fields = ["id", "name", "merchant", "owner", "capabilities", "is_active", "created_at"]
    readonly_fields = ["id", "name", "merchant", "owner", "is_active", "created_at"]
    inlines = [AgentKeyInline]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        # Taking a capability away is one step for one person; granting one is a proposal.
        held = set(Agent.objects.values_list("capabilities", flat=True).get(pk=obj.pk))
        wanted = set(form.cleaned_data["capabilities"])
        for capability in sorted(held - wanted):
            agents.revoke_capability(agent_id=obj.pk, capability=capability, actor=request.user)
        if wanted - held:
            super().save_model(request, obj, form, change)

    def proposal_changes(self, request, obj, form) -> dict:
        return {"capabilities": agents.validate_capabilities(form.cleaned_data["capabilities"])}

    def response_change(self, request, obj):
        if hasattr(request, "_proposal") or hasattr(request, "_proposal_refused"):
            return super().response_change(request, obj)
        messages.success(request, f"Capabilities of {obj.name} now: {', '.join(obj.capabilities) or 'none'}.")
        return HttpResponseRedirect(request.path)

    def get_queryset(self, request):
        live = Q(keys__revoked_at__isnull=True) & (Q(keys__expires_at__isnull=True)
                                                   | Q(keys__expires_at__gt=timezone.now()))
        return super().get_queryset(request).annotate(n_live_keys=Count("keys", filter=live))

    @admin.display(description="capabilities")
    def capability_list(self, obj: Agent) -> str:
        return ", ".join(obj.capabilities) or "none"

    @admin.display(description="live keys", ordering="n_live_keys")
    def live_keys(self, obj: Agent) -> int:
        return obj.n_live_keys


@admin.register(AgentKey)
class AgentKeyAdmin(ReadOnlyHistoryAdmin):
    """Keys by prefix only: the hash is never shown, the key itself was shown once at creation."""

    ordering = ["-created_at"]

    list_display = ["prefix", "agent", "created_at", "last_used_at", "expires_at", "revoked_at", "state"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), ("agent", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["prefix", "agent__name"]
    list_select_related = ["agent"]
    fields = ["prefix", "agent", "created_at", "last_used_at", "expires_at", "revoked_at", "state"]
    actions = ["revoke_selected"]

    @admin.display(description="state")
    def state(self, obj: AgentKey) -> str:
        if obj.revoked_at:
            return "revoked"
        if obj.expires_at and obj.expires_at <= timezone.now():
            return "expired"
        return "live"

    def has_revoke_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_agentkey")

    @admin.action(description="Revoke selected keys", permissions=["revoke"])
    def revoke_selected(self, request, queryset):
        prefixes = list(queryset.filter(revoked_at__isnull=True).values_list("prefix", flat=True))
        for prefix in prefixes:
            agents.revoke_key(prefix=prefix, actor=request.user)
        messages.success(request, f"Revoked {len(prefixes)} key(s): {', '.join(prefixes) or 'none were live'}.")


@admin.register(PlatformState)
class PlatformStateAdmin(ReadOnlyHistoryAdmin):
    """The switches that stop every agent at once. Only the actions below change them, through
    the same audited services as ``manage.py killswitch``."""

    list_display = ["__str__", "refunds_paused", "agents_disabled", "changed_by", "changed_at"]
    fields = ["refunds_paused", "agents_disabled", "changed_by", "changed_at"]
    actions = ["killswitch_on", "killswitch_off", "agents_off", "agents_on"]

    def changelist_view(self, request, extra_context=None):
        PlatformState.current()  # the one row exists, so the actions always have it to act on
        return super().changelist_view(request, extra_context)

    def has_switch_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_platformstate")

    def _report(self, request, state: PlatformState) -> None:
        messages.success(request, f"Now: {state}.")

    @admin.action(description="Kill switch ON: pause agent refunds", permissions=["switch"])
    def killswitch_on(self, request, queryset):
        self._report(request, agents.set_killswitch(on=True, actor=request.user))

    @admin.action(description="Kill switch off: resume agent refunds", permissions=["switch"])
    def killswitch_off(self, request, queryset):
        self._report(request, agents.set_killswitch(on=False, actor=request.user))

    @admin.action(description="Disable all agent access", permissions=["switch"])
    def agents_off(self, request, queryset):
        self._report(request, agents.set_agents_disabled(disabled=True, actor=request.user))

    @admin.action(description="Enable agent access", permissions=["switch"])
    def agents_on(self, request, queryset):
        self._report(request, agents.set_agents_disabled(disabled=False, actor=request.user))


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    """A record a refund request (kept, never purged: a million a year). Read newest first along
    ``idempotency_created_order``; the filters' choices from the latest rows and dates as ranges,
    not a ``SELECT DISTINCT`` and a ``MIN``/``MAX`` over every record on each page; counted by
    the planner's estimate."""

    ordering = ["-created_at"]
    list_display = ["key", "scope", "operation", "response_status", "created_at"]
    list_filter = [("operation", RecentValuesListFilter), ("response_status", RecentValuesListFilter),
                   ("created_at", admin.DateFieldListFilter)]
    # A key or a caller's scope as pasted, compared whole: a LIKE '%…%' read every record twice (the
    # page and its count), 0.43 s each at a million. No index on the key alone: one more random-key
    # index on the refund request's insert, for an operator's look-up (a year's scan: ~0.15 s).
    search_fields = ["key__exact", "scope__exact"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator


@admin.register(Merchant)
class MerchantAdmin(ProposeChangeMixin, HistoryAdmin):
    """Who owns payments, customers, agents and endpoints. Finance decides here whether refunds by
    the merchant's agents must name ``agent.session_id``: a change (or a new merchant) is a
    proposal a second person approves."""

    proposal_kind = Proposal.Kind.MERCHANT

    list_display = ["name", "id", "require_session_id", "created_at"]
    search_fields = ["name", "id"]
    fields = ["id", "name", "require_session_id", "created_at"]
    readonly_fields = ["id", "created_at"]

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # payments, agents and endpoints point at it


@admin.register(AgentRead)
class AgentReadAdmin(ReadOnlyAdmin):
    """Who looked at which payment or refund, and with which key."""

    list_display = ["read_at", "agent_id", "key_prefix", "operation", "payment_id", "refund_id"]
    list_filter = [("operation", RecentValuesListFilter), ("read_at", admin.DateFieldListFilter)]
    search_fields = ["=agent_id", "=payment_id", "=refund_id", "=key_prefix"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator  # millions of reads: the planner's estimate, not a COUNT(*)
